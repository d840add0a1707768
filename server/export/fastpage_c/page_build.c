/* A page's turns and rollouts from its rows: what ``page_rollouts`` (server/export/page_rollouts.py)
 * builds, the same filters, leaves, paths, shared turns and rewards. */
#include "page.h"

#include <datetime.h>

/* ``_json_loads`` (server/export/query.py) of a str, its checks in C: orjson's reading unless the text
 * holds a run of 19 digits (maybe an integer beyond 64 bits) or orjson refuses it (NaN, ...): then the
 * decoder's own. New reference */
static PyObject *loads(Opts *o, PyObject *raw) {
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(raw, &n);
    if (!s) return NULL;
    if (n == 4 && memcmp(s, "null", 4) == 0) Py_RETURN_NONE;
    int run = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        run = s[i] >= '0' && s[i] <= '9' ? run + 1 : 0;
        if (run >= 19) return PyObject_CallOneArg(o->json, raw);
    }
    PyObject *value = PyObject_CallOneArg(o->loads, raw);
    if (!value && PyErr_ExceptionMatches(PyExc_ValueError)) {
        PyErr_Clear();
        value = PyObject_CallOneArg(o->json, raw);
    }
    return value;
}

/* ``Decoders.json`` of a raw JSON column, once per distinct text in the page: new reference */
PyObject *decode(Opts *o, PyObject *raw) {
    if (raw == Py_None) Py_RETURN_NONE;  /* (every decoder's None) */
    PyObject *value = PyDict_GetItemWithError(o->decoded, raw);
    if (value) {
        Py_INCREF(value);
        return value;
    }
    if (PyErr_Occurred()) {  /* an unhashable raw value (already decoded): decode it each time */
        PyErr_Clear();
        return PyObject_CallOneArg(o->json, raw);
    }
    value = o->loads != Py_None && PyUnicode_CheckExact(raw) ? loads(o, raw) : PyObject_CallOneArg(o->json, raw);
    if (value && PyDict_SetItem(o->decoded, raw, value) < 0) Py_CLEAR(value);
    return value;
}

void page_free(Page *p) {
    for (Py_ssize_t i = 0; i < p->n_turns; i++) {
        Turn *t = &p->turns[i];
        Py_XDECREF(t->prompt);
        Py_XDECREF(t->completion);
        Py_XDECREF(t->logprobs);
        Py_XDECREF(t->work);
        Py_XDECREF(t->reward);
        Py_XDECREF(t->temperature);
        Py_XDECREF(t->sampling);
        PyMem_Free(t->spans);
    }
    PyMem_Free(p->turns);
    for (Py_ssize_t i = 0; i < p->n_rollouts; i++) {
        Rollout *r = &p->rollouts[i];
        PyMem_Free(r->turns);
        Py_XDECREF(r->reward);
        for (Py_ssize_t j = 0; j < r->n_paths; j++) {
            Py_XDECREF(r->paths[j].path);
        }
        PyMem_Free(r->paths);
        Py_XDECREF(r->leaf_work);
    }
    PyMem_Free(p->rollouts);
    Py_XDECREF(p->index);
}

/* a row's field (new reference) */
PyObject *field(PyObject *row, Py_ssize_t i) {
    if (PyTuple_CheckExact(row)) {
        if (i >= PyTuple_GET_SIZE(row)) {
            PyErr_SetString(PyExc_IndexError, "row too short");
            return NULL;
        }
        PyObject *v = PyTuple_GET_ITEM(row, i);
        Py_INCREF(v);
        return v;
    }
    return PySequence_GetItem(row, i);
}

static int str_is(PyObject *v, const char *s) {
    return PyUnicode_Check(v) && PyUnicode_CompareWithASCIIString(v, s) == 0;
}

/* a packed int32/float32 column as bytes (``packed_blob``): new reference; NULL with an error set */
static PyObject *packed(PyObject *value, const char *kind) {
    int truth = PyObject_IsTrue(value);
    if (truth < 0) return NULL;
    if (!truth) return PyBytes_FromStringAndSize(NULL, 0);
    PyObject *b;
    if (PyBytes_CheckExact(value)) {
        Py_INCREF(value);
        b = value;
    } else {
        b = PyObject_Bytes(value);
        if (!b) return NULL;
    }
    if (PyBytes_GET_SIZE(b) % 4) {
        PyErr_Format(PyExc_ValueError, "packed %s blob has %zd bytes, not a multiple of 4", kind,
                     PyBytes_GET_SIZE(b));
        Py_DECREF(b);
        return NULL;
    }
    return b;
}

/* ``stored_spans``: the message's [start, version] spans; 0 ok, -1 error, 1 not a shape this code takes */
static int read_spans(Opts *o, PyObject *raw, Turn *t) {
    PyObject *spans = decode(o, raw);
    if (!spans) return -1;
    int truth = PyObject_IsTrue(spans);
    if (truth < 0) {
        Py_DECREF(spans);
        return -1;
    }
    if (!truth) {
        Py_DECREF(spans);
        t->spans = PyMem_Malloc(sizeof(Span));
        if (!t->spans) {
            PyErr_NoMemory();
            return -1;
        }
        t->spans[0].start = t->spans[0].version = 0;
        t->n_spans = 1;
        return 0;
    }
    if (!PyList_CheckExact(spans)) {
        Py_DECREF(spans);
        return 1;
    }
    Py_ssize_t n = PyList_GET_SIZE(spans);
    t->spans = PyMem_Malloc(sizeof(Span) * (size_t)n);
    if (!t->spans) {
        Py_DECREF(spans);
        PyErr_NoMemory();
        return -1;
    }
    t->n_spans = n;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(spans, i);
        if (!PyList_CheckExact(pair) || PyList_GET_SIZE(pair) != 2) {
            Py_DECREF(spans);
            return 1;
        }
        long long vals[2];
        for (int j = 0; j < 2; j++) {
            PyObject *x = PyList_GET_ITEM(pair, j);
            if (!PyLong_CheckExact(x)) {  /* int(x) of a float or a string: the Python builder */
                Py_DECREF(spans);
                return 1;
            }
            int overflow = 0;
            vals[j] = PyLong_AsLongLongAndOverflow(x, &overflow);
            if (overflow || (vals[j] == -1 && PyErr_Occurred())) {
                PyErr_Clear();
                Py_DECREF(spans);
                return 1;
            }
        }
        t->spans[i].start = vals[0];
        t->spans[i].version = vals[1];
    }
    Py_DECREF(spans);
    return 0;
}

/* the turn's work parameters, decoded ({} for none): new reference, NULL with an error, or Py_None
 * (not a dict: the Python builder) */
static PyObject *read_work(Opts *o, PyObject *raw) {
    PyObject *work = decode(o, raw);
    if (!work) return NULL;
    int truth = PyObject_IsTrue(work);
    if (truth < 0) {
        Py_DECREF(work);
        return NULL;
    }
    if (!truth) {
        Py_DECREF(work);
        return PyDict_New();
    }
    if (!PyDict_CheckExact(work)) {
        Py_DECREF(work);
        Py_RETURN_NONE;
    }
    return work;
}

/* --- the members of the work parameters a record takes, without decoding the rest (json_members.c) --- */

enum { W_SAMPLING, W_SEED, W_SYSTEM, W_TOOLS, W_COUNT };
static const char *const WORK_MEMBERS[W_COUNT] = {"sampling_parameters", "seed", "system_prompt", "tools"};

typedef struct {
    const char *s;
    Py_ssize_t start[W_COUNT], end[W_COUNT];
} WorkText;

/* 1: the members of a str of work parameters found (``w``), 0: not taken here (decode it all), -1 error */
static int work_text(Opts *o, PyObject *raw, WorkText *w) {
    if (o->loads == Py_None || !PyUnicode_CheckExact(raw)) return 0;  /* (another decoder: its own reading) */
    Py_ssize_t n;
    w->s = PyUnicode_AsUTF8AndSize(raw, &n);
    if (!w->s) {  /* a lone surrogate: the decoder's */
        PyErr_Clear();
        return 0;
    }
    return json_members(w->s, n, WORK_MEMBERS, W_COUNT, w->start, w->end);
}

/* member j decoded as the whole text's decoding would give it (None where absent): new reference */
static PyObject *work_member(Opts *o, const WorkText *w, int j) {
    if (w->start[j] < 0) Py_RETURN_NONE;
    const char *v = w->s + w->start[j];
    Py_ssize_t len = w->end[j] - w->start[j];
    if (len == 4 && memcmp(v, "null", 4) == 0) Py_RETURN_NONE;
    Py_ssize_t i = v[0] == '-';
    long long x = 0;
    while (i < len && v[i] >= '0' && v[i] <= '9') x = x * 10 + (v[i++] - '0');  /* (at most 18 digits) */
    if (i == len && len > (v[0] == '-')) return PyLong_FromLongLong(v[0] == '-' ? -x : x);  /* an integer */
    PyObject *text = PyUnicode_DecodeUTF8(v, len, NULL);
    if (!text) return NULL;
    PyObject *value = decode(o, text);
    Py_DECREF(text);
    return value;
}

/* a turn's sampling record is its work's sampling parameters with "seed" set to the work's seed (where the
 * key is, or last) and its temperature the parameters' (1.0 where none): of ``params`` (decoded), the
 * record's JSON before the seed's value, after it, and the temperature. New reference; NULL with an error,
 * or Py_None: not a shape taken here */
static PyObject *sampling_parts_of(Opts *o, PyObject *params) {
    int truth = PyObject_IsTrue(params);
    if (truth < 0) return NULL;
    if (truth && !PyDict_Check(params)) Py_RETURN_NONE;
    Buf pre = {0}, post = {0};
    PyObject *temperature = NULL, *parts = NULL;
    int seen = 0, first = 1;
    if (buf_char(&pre, '{') < 0) goto done;
    if (truth) {
        PyObject *k, *v;
        Py_ssize_t pos = 0;
        while (PyDict_Next(params, &pos, &k, &v)) {
            Buf *b = seen ? &post : &pre;
            if ((!first && buf_char(b, ',') < 0) || buf_value(b, o, k) < 0 || buf_char(b, ':') < 0) goto done;
            first = 0;
            if (PyUnicode_Check(k) && PyUnicode_CompareWithASCIIString(k, "seed") == 0) seen = 1;
            else if (buf_value(b, o, v) < 0) goto done;
        }
    }
    if (!seen && ((!first && buf_char(&pre, ',') < 0) || PUT_LIT(&pre, "\"seed\":") < 0)) goto done;
    if (buf_char(&post, '}') < 0) goto done;
    PyObject *temp = truth ? get(params, K_TEMPERATURE) : Py_None;
    temperature = temp == Py_None ? PyFloat_FromDouble(1.0) : PyNumber_Float(temp);
    if (temperature) parts = Py_BuildValue("(y#y#O)", pre.data, pre.len, post.data, post.len, temperature);
done:
    PyMem_Free(pre.data);
    PyMem_Free(post.data);
    Py_XDECREF(temperature);
    return parts;
}

/* ``sampling_parts_of`` the sampling parameters in the work's text, once per distinct text. Borrowed */
static PyObject *sampling_parts(Opts *o, const WorkText *w) {
    PyObject *key;
    if (w->start[W_SAMPLING] < 0) {
        key = Py_NewRef(Py_None);
    } else {
        key = PyUnicode_DecodeUTF8(w->s + w->start[W_SAMPLING], w->end[W_SAMPLING] - w->start[W_SAMPLING], NULL);
        if (!key) return NULL;
    }
    PyObject *parts = PyDict_GetItemWithError(o->sampling_parts, key);
    if (!parts && !PyErr_Occurred()) {
        PyObject *params = key == Py_None ? Py_NewRef(Py_None) : decode(o, key);
        PyObject *made = params ? sampling_parts_of(o, params) : NULL;
        if (made && PyDict_SetItem(o->sampling_parts, key, made) == 0) parts = made;  /* (the dict holds it) */
        Py_XDECREF(made);
        Py_XDECREF(params);
    }
    Py_DECREF(key);
    return parts;
}

/* the turn's sampling record and temperature from ``parts`` and the work's seed: 0, -1 error */
static int put_sampling(Opts *o, PyObject *parts, PyObject *seed, Turn *t) {
    PyObject *pre = PyTuple_GET_ITEM(parts, 0), *post = PyTuple_GET_ITEM(parts, 1);
    Buf b = {0};
    int rc = buf_put(&b, PyBytes_AS_STRING(pre), PyBytes_GET_SIZE(pre));
    if (rc == 0) rc = buf_value(&b, o, seed);
    if (rc == 0) rc = buf_put(&b, PyBytes_AS_STRING(post), PyBytes_GET_SIZE(post));
    if (rc == 0 && !(t->sampling = PyBytes_FromStringAndSize(b.data, b.len))) rc = -1;
    PyMem_Free(b.data);
    if (rc < 0) return -1;
    t->temperature = Py_NewRef(PyTuple_GET_ITEM(parts, 2));
    return 0;
}

/* the turn's sampling from the members of its work's text: 0, -1 error, 1 not a shape taken here */
static int quick_sampling(Opts *o, const WorkText *w, Turn *t) {
    PyObject *parts = sampling_parts(o, w);
    if (!parts) return -1;
    if (parts == Py_None) return 1;
    PyObject *seed = work_member(o, w, W_SEED);
    if (!seed) return -1;
    int rc = put_sampling(o, parts, seed, t);
    Py_DECREF(seed);
    return rc;
}

/* the turn's sampling from its decoded work (t->work, a dict): 0, -1 error, 1 not a shape taken here */
static int read_sampling(Opts *o, Turn *t) {
    PyObject *parts = sampling_parts_of(o, get(t->work, K_SAMPLING));
    if (!parts) return -1;
    int rc = parts == Py_None ? 1 : put_sampling(o, parts, get(t->work, K_SEED), t);
    Py_DECREF(parts);
    return rc;
}

/* a leaf's work parameters: a dict with what its record takes (system prompt and tools), from the
 * members of its text, else ``read_work`` */
static PyObject *leaf_work(Opts *o, PyObject *raw) {
    WorkText w;
    int found = work_text(o, raw, &w);
    if (found < 0) return NULL;
    if (!found) return read_work(o, raw);
    PyObject *work = PyDict_New(), *system = work_member(o, &w, W_SYSTEM), *tools = work_member(o, &w, W_TOOLS);
    if (!work || !system || !tools || PyDict_SetItem(work, K_SYSTEM_PROMPT, system) < 0 ||
        PyDict_SetItem(work, K_TOOLS, tools) < 0)
        Py_CLEAR(work);
    Py_XDECREF(system);
    Py_XDECREF(tools);
    return work;
}

/* ``_Builder.turn``: adds the turn of message row m with token row t after turn prev (-1: first).
 * Returns its number, -1 where the version filters leave it out, -2 on error, -3 malformed */
static Py_ssize_t add_turn(Page *p, PyObject *m, PyObject *t, Py_ssize_t prev, PyObject *mid) {
    Opts *o = p->o;
    if (p->n_turns == p->cap_turns) {
        Py_ssize_t cap = p->cap_turns ? p->cap_turns * 2 : 256;
        Turn *turns = PyMem_Realloc(p->turns, sizeof(Turn) * (size_t)cap);
        if (!turns) {
            PyErr_NoMemory();
            return -2;
        }
        p->turns = turns;
        p->cap_turns = cap;
    }
    Turn *tu = &p->turns[p->n_turns];
    memset(tu, 0, sizeof(Turn));
    p->n_turns++;  /* freed with the page whatever happens next */
    tu->msg = m;
    tu->tok = t;
    PyObject *raw = field(m, M_POLICY);
    if (!raw) return -2;
    int rc = read_spans(o, raw, tu);
    Py_DECREF(raw);
    if (rc) return rc < 0 ? -2 : -3;
    PyObject *v;
    if (!(v = field(t, T_PROMPT))) return -2;
    tu->prompt = packed(v, "id");
    Py_DECREF(v);
    if (!tu->prompt) return -2;
    if (!(v = field(t, T_COMPLETION))) return -2;
    tu->completion = packed(v, "id");
    Py_DECREF(v);
    if (!tu->completion) return -2;
    if (!(v = field(t, T_LOGPROBS))) return -2;
    int truth = PyObject_IsTrue(v);
    if (truth < 0) {
        Py_DECREF(v);
        return -2;
    }
    if (!truth) {
        tu->logprobs = PyBytes_FromStringAndSize(NULL, 0);
    } else if (PyBytes_CheckExact(v)) {
        Py_INCREF(v);
        tu->logprobs = v;
    } else {
        tu->logprobs = PyObject_Bytes(v);
    }
    Py_DECREF(v);
    if (!tu->logprobs) return -2;
    Py_ssize_t clen = PyBytes_GET_SIZE(tu->completion);
    if (PyBytes_GET_SIZE(tu->logprobs) != clen) return -3;
    for (int i = T_REUSED; i <= T_SYNTH; i++) {  /* the closer's slice: non-negative integers here */
        if (!(v = field(t, i))) return -2;
        int ok = PyLong_CheckExact(v) && PyLong_AsLongLong(v) >= 0;
        Py_DECREF(v);
        if (PyErr_Occurred()) PyErr_Clear();  /* (beyond 64 bits: not ok) */
        if (!ok) return -3;
    }
    tu->n_prompt = PyBytes_GET_SIZE(tu->prompt) >> 2;
    tu->n_completion = clen >> 2;
    if (o->recent_enough != Py_None) {
        PyObject *used = PyList_New(0);
        if (!used) return -2;
        for (Py_ssize_t i = 0; i < tu->n_spans; i++) {
            if (tu->spans[i].start < tu->n_completion) {
                PyObject *x = PyLong_FromLongLong(tu->spans[i].version);
                if (!x || PyList_Append(used, x) < 0) {
                    Py_XDECREF(x);
                    Py_DECREF(used);
                    return -2;
                }
                Py_DECREF(x);
            }
        }
        PyObject *model = field(m, M_MODEL);
        if (!model) {
            Py_DECREF(used);
            return -2;
        }
        PyObject *ok = PyObject_CallFunctionObjArgs(o->recent_enough, used, model, NULL);
        Py_DECREF(used);
        Py_DECREF(model);
        if (!ok) return -2;
        int pass = PyObject_IsTrue(ok);
        Py_DECREF(ok);
        if (pass < 0) return -2;
        if (!pass) {  /* no turn: taken off the page's again */
            Py_CLEAR(tu->prompt);
            Py_CLEAR(tu->completion);
            Py_CLEAR(tu->logprobs);
            PyMem_Free(tu->spans);
            p->n_turns--;
            if (PyDict_SetItem(p->index, mid, Py_None) < 0) return -2;
            return -1;
        }
    }
    if (prev < 0) {
        tu->extends = 1;
        tu->prev_len = 0;
    } else {
        Turn *pt = &p->turns[prev];
        Py_ssize_t lp = PyBytes_GET_SIZE(pt->prompt), lc = PyBytes_GET_SIZE(pt->completion);
        const char *s = PyBytes_AS_STRING(tu->prompt);
        Py_ssize_t ls = PyBytes_GET_SIZE(tu->prompt);
        tu->extends = ls >= lp + lc && memcmp(s, PyBytes_AS_STRING(pt->prompt), (size_t)lp) == 0 &&
                      memcmp(s + lp, PyBytes_AS_STRING(pt->completion), (size_t)lc) == 0;
        tu->prev_len = tu->extends ? (lp + lc) >> 2 : 0;
    }
    /* the reward: the environment's, else the vote's score */
    PyObject *reward = field(m, M_REWARD);
    if (!reward) return -2;
    if (reward != Py_None) {
        tu->reward = PyNumber_Float(reward);
        Py_DECREF(reward);
        if (!tu->reward) return -2;
    } else {
        Py_DECREF(reward);
        PyObject *voted = field(m, M_VOTED);
        if (!voted) return -2;
        int is_voted = PyObject_IsTrue(voted);
        Py_DECREF(voted);
        if (is_voted < 0) return -2;
        if (is_voted) {
            PyObject *score = field(m, M_SCORE);
            if (!score) return -2;
            tu->reward = PyNumber_Float(score);
            Py_DECREF(score);
            if (!tu->reward) return -2;
        }
    }
    if (!(raw = field(m, M_WORK))) return -2;
    WorkText w;
    int found = work_text(o, raw, &w);
    if (found) {  /* (tu->work stays NULL: the leaf reads its own) */
        rc = found < 0 ? -1 : quick_sampling(o, &w, tu);
        Py_DECREF(raw);
        if (rc) return rc < 0 ? -2 : -3;
        goto indexed;
    }
    tu->work = read_work(o, raw);
    if (tu->work && tu->work != Py_None) rc = read_sampling(o, tu);
    Py_DECREF(raw);
    if (!tu->work) return -2;
    if (tu->work == Py_None) return -3;
    if (rc) return rc < 0 ? -2 : -3;
indexed:;
    Py_ssize_t k = p->n_turns - 1;
    PyObject *key = PyLong_FromSsize_t(k);
    if (!key) return -2;
    rc = PyDict_SetItem(p->index, mid, key);
    Py_DECREF(key);
    return rc < 0 ? -2 : k;
}

/* the turn rewards' rollout reward (``rollout_reward``): new reference or NULL without error for none */
static PyObject *rollout_reward(Page *p, Py_ssize_t *turns, Py_ssize_t n) {
    int rule = p->o->rule;
    if (rule == RULE_LEAF) {
        PyObject *r = p->turns[turns[n - 1]].reward;
        Py_XINCREF(r);
        return r;
    }
    if (rule == RULE_MEAN) {  /* sum() as Python's: its float summation changed between versions */
        PyObject *rated = PyList_New(0);
        if (!rated) return NULL;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *r = p->turns[turns[i]].reward;
            if (r && PyList_Append(rated, r) < 0) {
                Py_DECREF(rated);
                return NULL;
            }
        }
        PyObject *mean = NULL;
        Py_ssize_t count = PyList_GET_SIZE(rated);
        if (count) {
            PyObject *total = PyObject_CallOneArg(SUM, rated), *len = PyLong_FromSsize_t(count);
            if (total && len) mean = PyNumber_TrueDivide(total, len);
            Py_XDECREF(total);
            Py_XDECREF(len);
        }
        Py_DECREF(rated);
        return mean;
    }
    double acc = 0;
    Py_ssize_t rated = 0;
    PyObject *last = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = p->turns[turns[i]].reward;
        if (!r) continue;
        double x = PyFloat_AS_DOUBLE(r);
        if (rule == RULE_MIN) {
            if (!rated || x < acc) {  /* Python's min keeps the first of equal values */
                acc = x;
                last = r;
            }
        } else last = r;
        rated++;
    }
    if (!rated) return NULL;
    Py_INCREF(last);
    return last;
}

static int add_path(Rollout *r, Opts *o, PyObject *model, long long v) {
    Py_ssize_t j;
    for (j = 0; j < r->n_paths && r->paths[j].v != v; j++) {
    }
    if (j < r->n_paths && r->paths[j].path != Py_None) return 0;
    PyObject *path;
    if (v) {
        PyObject *version = PyLong_FromLongLong(v);
        if (!version) return -1;
        path = PyObject_CallFunctionObjArgs(o->path, model, version, NULL);
        Py_DECREF(version);
        if (!path) return -1;
    } else {
        Py_INCREF(Py_None);
        path = Py_None;
    }
    if (j < r->n_paths) {
        Py_SETREF(r->paths[j].path, path);
        return 0;
    }
    PathEntry *entries = PyMem_Realloc(r->paths, sizeof(PathEntry) * (size_t)(r->n_paths + 1));
    if (!entries) {
        Py_DECREF(path);
        PyErr_NoMemory();
        return -1;
    }
    r->paths = entries;
    r->paths[r->n_paths].v = v;
    r->paths[r->n_paths].path = path;
    r->n_paths++;
    return 0;
}

/* ``_Builder.rollout``: 0 added or left out, -1 error, -3 malformed */
static int add_rollout(Page *p, PyObject *chat_id, PyObject *user_id, PyObject *by_id, PyObject *leaf,
                       PyObject *tokens, Py_ssize_t max_path) {
    Opts *o = p->o;
    if (o->leaf_passes != Py_None) {
        PyObject *ok = PyObject_CallOneArg(o->leaf_passes, leaf);
        if (!ok) return -1;
        int pass = PyObject_IsTrue(ok);
        Py_DECREF(ok);
        if (pass <= 0) return pass;
    }
    /* the assistant messages a worker generated, root to leaf (borrowed rows) */
    PyObject **path = PyMem_Malloc(sizeof(PyObject *) * (size_t)(max_path + 1));
    Py_ssize_t *turns = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(max_path + 1));
    Py_ssize_t n_path = 0, n_turns = 0;
    int rc = -1;
    if (!path || !turns) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject *cur = field(leaf, M_ID);
    if (!cur) goto done;
    Py_ssize_t steps = 0;
    while (cur != Py_None) {
        PyObject *row = PyDict_GetItemWithError(by_id, cur);
        Py_DECREF(cur);
        cur = NULL;
        if (!row) {
            if (PyErr_Occurred()) goto done;
            break;
        }
        if (++steps > max_path) {  /* a cycle of parents: the Python builder would not end either */
            rc = -3;
            goto done;
        }
        PyObject *role = field(row, M_ROLE), *state = field(row, M_STATE);
        if (!role || !state) {
            Py_XDECREF(role);
            Py_XDECREF(state);
            goto done;
        }
        if (str_is(role, "assistant") && !str_is(state, "manual")) path[n_path++] = row;
        Py_DECREF(role);
        Py_DECREF(state);
        if (!(cur = field(row, M_PARENT))) goto done;
    }
    Py_XDECREF(cur);
    int complete = 1;
    for (Py_ssize_t i = n_path - 1; i >= 0; i--) {
        PyObject *id = field(path[i], M_ID);
        if (!id) goto done;
        int has = PyDict_Contains(tokens, id);
        Py_DECREF(id);
        if (has < 0) goto done;
        if (!has) {
            complete = 0;
            break;
        }
    }
    if (!complete && !o->include_incomplete) {
        rc = 0;
        goto done;
    }
    Py_ssize_t prev = -1;
    for (Py_ssize_t i = n_path - 1; i >= 0; i--) {
        PyObject *m = path[i];
        PyObject *id = field(m, M_ID);
        if (!id) goto done;
        PyObject *t = PyDict_GetItemWithError(tokens, id);
        if (!t) {
            Py_DECREF(id);
            if (PyErr_Occurred()) goto done;
            continue;
        }
        Py_ssize_t k;
        PyObject *known = PyDict_GetItemWithError(p->index, id);
        if (known) {
            k = known == Py_None ? -1 : PyLong_AsSsize_t(known);
        } else if (PyErr_Occurred()) {
            Py_DECREF(id);
            goto done;
        } else {
            k = add_turn(p, m, t, prev, id);
        }
        Py_DECREF(id);
        if (k == -2) goto done;
        if (k == -3) {
            rc = -3;
            goto done;
        }
        if (k == -1) {
            rc = 0;
            goto done;
        }
        turns[n_turns++] = k;
        prev = k;
    }
    if (!n_turns) {
        rc = 0;
        goto done;
    }
    if (o->rated_only) {
        int any = 0;
        for (Py_ssize_t i = 0; i < n_turns; i++) any |= p->turns[turns[i]].reward != NULL;
        if (!any) {
            rc = 0;
            goto done;
        }
    }
    PyObject *reward = rollout_reward(p, turns, n_turns);
    if (!reward && PyErr_Occurred()) goto done;
    if (o->has_min_score && (!reward || PyFloat_AsDouble(reward) < o->min_score)) {
        Py_XDECREF(reward);
        rc = 0;
        goto done;
    }
    if (p->n_rollouts == p->cap_rollouts) {
        Py_ssize_t cap = p->cap_rollouts ? p->cap_rollouts * 2 : 256;
        Rollout *rs = PyMem_Realloc(p->rollouts, sizeof(Rollout) * (size_t)cap);
        if (!rs) {
            Py_XDECREF(reward);
            PyErr_NoMemory();
            goto done;
        }
        p->rollouts = rs;
        p->cap_rollouts = cap;
    }
    Rollout *r = &p->rollouts[p->n_rollouts++];
    memset(r, 0, sizeof(Rollout));
    r->chat_id = chat_id;
    r->user_id = user_id;
    r->leaf = leaf;
    r->turns = turns;
    turns = NULL;
    r->n_turns = n_turns;
    r->reward = reward;
    r->complete = complete;
    for (Py_ssize_t i = 0; i < n_turns; i++) {
        Turn *tu = &p->turns[r->turns[i]];
        PyObject *model = field(tu->msg, M_MODEL);
        if (!model) goto done;
        if (model == Py_None) {
            Py_DECREF(model);
            model = PyUnicode_FromStringAndSize("", 0);
            if (!model) goto done;
        }
        for (Py_ssize_t j = 0; j < tu->n_spans; j++) {
            if (tu->spans[j].start < tu->n_completion && add_path(r, o, model, tu->spans[j].version) < 0) {
                Py_DECREF(model);
                goto done;
            }
        }
        Py_DECREF(model);
    }
    Turn *last = &p->turns[r->turns[n_turns - 1]];
    if (last->msg == leaf && last->work) {
        Py_INCREF(last->work);
        r->leaf_work = last->work;
    } else {
        PyObject *raw = field(leaf, M_WORK);
        if (!raw) goto done;
        r->leaf_work = leaf_work(o, raw);
        Py_DECREF(raw);
        if (!r->leaf_work) goto done;
        if (r->leaf_work == Py_None) {
            rc = -3;
            goto done;
        }
    }
    rc = 0;
done:
    PyMem_Free(path);
    PyMem_Free(turns);
    return rc;
}

/* ``_Builder.chat``: the rollouts of one chat's leaves; 0, -1 error, -3 malformed */
int add_chat(Page *p, PyObject *chat) {
    if (!PyTuple_Check(chat) || PyTuple_GET_SIZE(chat) != 4) {
        PyErr_SetString(PyExc_TypeError, "a chat is (chat id, user id, message rows, token rows by id)");
        return -1;
    }
    PyObject *chat_id = PyTuple_GET_ITEM(chat, 0), *user_id = PyTuple_GET_ITEM(chat, 1);
    PyObject *msgs = PySequence_Fast(PyTuple_GET_ITEM(chat, 2), "message rows");
    PyObject *tokens = PyTuple_GET_ITEM(chat, 3);
    if (!msgs) return -1;
    if (!PyDict_Check(tokens)) {
        Py_DECREF(msgs);
        PyErr_SetString(PyExc_TypeError, "token rows by message id: a dict");
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(msgs);
    PyObject **rows = PySequence_Fast_ITEMS(msgs);
    int rc = -1;
    PyObject *by_id = PyDict_New(), *below = PySet_New(NULL);
    char *generated = PyMem_Malloc((size_t)n + 1);  /* an assistant message a worker generated */
    if (!by_id || !below || !generated) {
        if (!generated) PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *id = field(rows[i], M_ID);
        if (!id) goto done;
        int err = PyDict_SetItem(by_id, id, rows[i]);
        Py_DECREF(id);
        if (err < 0) goto done;
        PyObject *role = field(rows[i], M_ROLE), *state = field(rows[i], M_STATE);
        if (!role || !state) {
            Py_XDECREF(role);
            Py_XDECREF(state);
            goto done;
        }
        generated[i] = (char)(str_is(role, "assistant") && !str_is(state, "manual"));
        Py_DECREF(role);
        Py_DECREF(state);
    }
    /* ``leaves``: the generated messages with no generated message below them */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!generated[i]) continue;
        PyObject *parent = field(rows[i], M_PARENT);
        if (!parent) goto done;
        Py_ssize_t steps = 0;
        for (;;) {
            PyObject *row = PyDict_GetItemWithError(by_id, parent);
            if (!row) {
                if (PyErr_Occurred()) {
                    Py_DECREF(parent);
                    goto done;
                }
                break;
            }
            int seen = PySet_Contains(below, parent);
            if (seen < 0 || (!seen && PySet_Add(below, parent) < 0)) {
                Py_DECREF(parent);
                goto done;
            }
            if (seen) break;
            if (++steps > n) {  /* a cycle: the Python builder takes it (and never ends) */
                Py_DECREF(parent);
                rc = -3;
                goto done;
            }
            Py_DECREF(parent);
            if (!(parent = field(row, M_PARENT))) goto done;
        }
        Py_DECREF(parent);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!generated[i]) continue;
        PyObject *id = field(rows[i], M_ID);
        if (!id) goto done;
        int is_below = PySet_Contains(below, id);
        Py_DECREF(id);
        if (is_below < 0) goto done;
        if (is_below) continue;
        int r = add_rollout(p, chat_id, user_id, by_id, rows[i], tokens, n);
        if (r) {
            rc = r;
            goto done;
        }
    }
    rc = 0;
done:
    Py_XDECREF(by_id);
    Py_XDECREF(below);
    PyMem_Free(generated);
    Py_DECREF(msgs);
    return rc;
}

/* a dict's value (borrowed; Py_None where absent) */
PyObject *get(PyObject *dict, PyObject *key) {
    PyObject *v = PyDict_GetItemWithError(dict, key);
    if (!v) PyErr_Clear();  /* (an unhashable key cannot be one of these) */
    return v ? v : Py_None;
}


/* ``created_texts``' fast paths, as isoformat writes the value into iso: the length; 0 for any other value
 * (the caller's conversion); -1 error. SQLite stores ``YYYY-MM-DD HH:MM:SS.ffffff`` (ASCII, so that its
 * 26 bytes are 26 characters); asyncpg gives datetimes in UTC (where the decoder leaves them as they are:
 * no ``created`` callable) */
int plain_created(Opts *o, PyObject *raw, char iso[CREATED_MAX]) {
    if (o->created == Py_None && PyDateTime_CheckExact(raw) &&
        PyDateTime_DATE_GET_TZINFO(raw) == PyDateTime_TimeZone_UTC) {
        int year = PyDateTime_GET_YEAR(raw), us = PyDateTime_DATE_GET_MICROSECOND(raw);
        int parts[6] = {year, PyDateTime_GET_MONTH(raw), PyDateTime_GET_DAY(raw), PyDateTime_DATE_GET_HOUR(raw),
                        PyDateTime_DATE_GET_MINUTE(raw), PyDateTime_DATE_GET_SECOND(raw)};
        /* "YYYY-MM-DDTHH:MM:SS[.ffffff]+00:00" (snprintf's formatting was a few percent of a page) */
        static const char seps[6] = "--T::";
        char *s = iso;
        s[0] = (char)('0' + year / 1000), s[1] = (char)('0' + year / 100 % 10), s[2] = (char)('0' + year / 10 % 10),
        s[3] = (char)('0' + year % 10), s[4] = '-';
        s += 5;
        for (int i = 1; i < 6; i++) {
            s[0] = (char)('0' + parts[i] / 10), s[1] = (char)('0' + parts[i] % 10);
            s += 2;
            if (i < 5) *s++ = seps[i];
        }
        if (us) {
            *s++ = '.';
            for (int k = 5; k >= 0; k--, us /= 10) s[k] = (char)('0' + us % 10);
            s += 6;
        }
        memcpy(s, "+00:00", 6);
        return (int)(s + 6 - iso);
    }
    if (!PyUnicode_CheckExact(raw)) return 0;
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(raw, &n);
    if (!s) return -1;
    if (n != 26 || s[10] != ' ' || s[19] != '.' || memcmp(s + 20, "000000", 6) == 0) return 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (s[i] < 0x20 || s[i] >= 0x7f) return 0;
    memcpy(iso, s, 26);
    iso[10] = 'T';
    return 26;
}

/* any other created_at: ``created(raw)``, or without that callable raw.isoformat() (None: None) */
PyObject *created_text(Opts *o, PyObject *raw) {
    if (o->created != Py_None) return PyObject_CallOneArg(o->created, raw);
    if (raw == Py_None) Py_RETURN_NONE;
    return PyObject_CallMethod(raw, "isoformat", NULL);
}

int created_init(void) {
    PyDateTime_IMPORT;
    return PyDateTimeAPI ? 0 : -1;
}

/* the version of each of the turn's completion tokens (``token_versions``; int32 as the page path's
 * arrays): NO_VERSION, then each span's version from its start to the next span's */
void turn_versions(const Turn *t, int32_t *out) {
    Py_ssize_t n = t->n_completion;
    if (t->n_spans == 1 && !t->spans[0].start) {
        for (Py_ssize_t i = 0; i < n; i++) out[i] = (int32_t)t->spans[0].version;
        return;
    }
    for (Py_ssize_t i = 0; i < n; i++) out[i] = -1;
    for (Py_ssize_t k = 0; k < t->n_spans; k++) {
        long long a = t->spans[k].start < 0 ? 0 : t->spans[k].start;
        long long e = k + 1 < t->n_spans ? t->spans[k + 1].start : n;
        if (e > n) e = n;
        for (long long i = a; i < e; i++) out[i] = (int32_t)t->spans[k].version;
    }
}
