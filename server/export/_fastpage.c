/* A page of native rollouts as JSON lines, built and written in C: the bytes of
 * ``page_rollouts`` + ``page_lines`` (server/export/page_rollouts.py, page_jsonl.py) for the same rows.
 *
 * The Python page path spends its time on objects made per turn and per rollout (dicts, lists, slices,
 * Fragments); here the rows are read where they are and the JSON is written into one buffer. What is
 * not plain data is still done by Python, through callables the caller passes: JSON columns are parsed
 * by ``Decoders.json``, non-SQLite timestamps by ``Decoders.datetime``, floats and free-form values
 * (sampling parameters, tool calls, tools) written by orjson, the filters that read dates or the
 * version registry asked of their Python functions. Anything this code does not expect (a value of
 * another shape, a turn whose logprobs do not line up with its completion) makes it return None, and
 * the caller builds that page the Python way; tests/test_export_pages.py compares the bytes of both.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* the row layouts of server/export/query.py (M_* and T_*): checked against it at import */
enum { M_ID, M_PARENT, M_ROLE, M_STATE, M_CONTENT, M_REASONING, M_TOOL_CALLS, M_MODEL, M_WORK, M_SCORE,
       M_VOTED, M_CREATED, M_CHAT, M_POLICY, M_REWARD, M_DONE, M_COUNT };
enum { T_ID, T_PROMPT, T_COMPLETION, T_LOGPROBS, T_FINISH, T_STOP, T_ENGINE, T_TOKENIZER, T_TEMPLATE,
       T_REUSED, T_SYNTH, T_FORK, T_METHOD, T_COUNT };

enum { RULE_LAST, RULE_MEAN, RULE_MIN, RULE_LEAF };

/* dict keys (interned at import) and builtins.sum */
static PyObject *K_SAMPLING, *K_SEED, *K_TEMPERATURE, *K_SYSTEM_PROMPT, *K_TOOLS, *SUM;
static PyObject *get(PyObject *dict, PyObject *key);

/* --- a growable byte buffer ------------------------------------------------------------------------ */

typedef struct {
    char *data;
    Py_ssize_t len, cap;
} Buf;

static int buf_reserve(Buf *b, Py_ssize_t extra) {
    if (b->len + extra <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 1 << 16;
    while (cap < b->len + extra) cap *= 2;
    char *data = PyMem_Realloc(b->data, (size_t)cap);
    if (!data) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static int buf_put(Buf *b, const char *s, Py_ssize_t n) {
    if (buf_reserve(b, n) < 0) return -1;
    memcpy(b->data + b->len, s, (size_t)n);
    b->len += n;
    return 0;
}

#define PUT_LIT(b, lit) buf_put((b), (lit), (Py_ssize_t)(sizeof(lit) - 1))

static int buf_char(Buf *b, char c) {
    if (buf_reserve(b, 1) < 0) return -1;
    b->data[b->len++] = c;
    return 0;
}

/* decimal text of v into out (at least 21 bytes); returns its length */
static int fmt_ll(char *out, long long v) {
    char tmp[24];
    int n = 0;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do {
        tmp[n++] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    int len = 0;
    if (v < 0) out[len++] = '-';
    while (n) out[len++] = tmp[--n];
    return len;
}

static int buf_ll(Buf *b, long long v) {
    if (buf_reserve(b, 24) < 0) return -1;
    b->len += fmt_ll(b->data + b->len, v);
    return 0;
}

/* n copies of item (with commas between) after ``*first`` items written (a comma before unless none) */
static int buf_repeat(Buf *b, const char *item, Py_ssize_t item_len, Py_ssize_t n, int *first) {
    if (n <= 0) return 0;
    if (buf_reserve(b, n * (item_len + 1)) < 0) return -1;
    char *p = b->data + b->len;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!*first) *p++ = ',';
        *first = 0;
        memcpy(p, item, (size_t)item_len);
        p += item_len;
    }
    b->len = p - b->data;
    return 0;
}

/* JSON string escapes as orjson writes them: \" \\ \b \t \n \f \r, other controls as \u00xx */
static const char HEX[] = "0123456789abcdef";

static int buf_json_str(Buf *b, PyObject *s) {
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(s, &n);
    if (!u) return -1;
    if (buf_reserve(b, n * 6 + 2) < 0) return -1;
    char *p = b->data + b->len;
    *p++ = '"';
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)u[i];
        if (c >= 0x20 && c != '"' && c != '\\') {
            *p++ = (char)c;
            continue;
        }
        *p++ = '\\';
        switch (c) {
            case '"': *p++ = '"'; break;
            case '\\': *p++ = '\\'; break;
            case '\b': *p++ = 'b'; break;
            case '\t': *p++ = 't'; break;
            case '\n': *p++ = 'n'; break;
            case '\f': *p++ = 'f'; break;
            case '\r': *p++ = 'r'; break;
            default:
                *p++ = 'u';
                *p++ = '0';
                *p++ = '0';
                *p++ = HEX[c >> 4];
                *p++ = HEX[c & 15];
        }
    }
    *p++ = '"';
    b->len = p - b->data;
    return 0;
}

/* --- what the caller passes -------------------------------------------------------------------------- */

typedef struct {
    int rated_only, include_incomplete, rule;
    int has_min_score;
    double min_score;
    PyObject *leaf_passes;    /* callable(leaf row) -> bool, or None: no model or date filter */
    PyObject *recent_enough;  /* callable(used versions, model) -> bool, or None: no version filter */
    PyObject *path;           /* callable(model, version) -> str | None */
    PyObject *json;           /* Decoders.json */
    PyObject *created;        /* callable(raw created_at) -> str | None (not SQLite's text) */
    PyObject *stop_reason;    /* decode_stop_reason */
    PyObject *dumps;          /* callable(value) -> bytes: orjson.dumps */
    PyObject *floats;         /* callable(float32 bytes) -> bytes: their JSON array, widened to float64 */
    PyObject *head;           /* b'{"schema":...,"schema_version":...' */
    PyObject *rule_text;      /* the reward rule's JSON text */
    PyObject *stop_cache;     /* dict: raw stop reason -> its JSON text */
    PyObject *decoded;        /* the page's JSON columns decoded: raw text -> value (read, never changed) */
    PyObject *samplings;      /* raw work parameters -> (sampling JSON text, temperature) */
} Opts;

/* ``Decoders.json`` of a raw JSON column, once per distinct text in the page: new reference */
static PyObject *decode(Opts *o, PyObject *raw) {
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
    value = PyObject_CallOneArg(o->json, raw);
    if (value && PyDict_SetItem(o->decoded, raw, value) < 0) Py_CLEAR(value);
    return value;
}

/* any value: JSON text (strings and integers here, the rest by orjson) */
static int buf_value(Buf *b, Opts *o, PyObject *v) {
    if (v == Py_None) return PUT_LIT(b, "null");
    if (v == Py_True) return PUT_LIT(b, "true");
    if (v == Py_False) return PUT_LIT(b, "false");
    if (PyUnicode_CheckExact(v)) return buf_json_str(b, v);
    if (PyLong_CheckExact(v)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (!overflow) {
            if (x == -1 && PyErr_Occurred()) return -1;
            return buf_ll(b, x);
        }
    }
    PyObject *text = PyObject_CallOneArg(o->dumps, v);
    if (!text) return -1;
    int rc = -1;
    if (PyBytes_Check(text)) rc = buf_put(b, PyBytes_AS_STRING(text), PyBytes_GET_SIZE(text));
    else PyErr_SetString(PyExc_TypeError, "dumps did not return bytes");
    Py_DECREF(text);
    return rc;
}

static int buf_bool(Buf *b, PyObject *v) {
    int t = PyObject_IsTrue(v);
    if (t < 0) return -1;
    return t ? PUT_LIT(b, "true") : PUT_LIT(b, "false");
}

/* --- a page's turns and rollouts ------------------------------------------------------------------- */

typedef struct {
    long long start, version;
} Span;

typedef struct {
    PyObject *msg, *tok;               /* borrowed: the rows live in the page's chats */
    PyObject *prompt, *completion, *logprobs;  /* owned bytes */
    Py_ssize_t n_prompt, n_completion, prev_len;
    int extends;
    Span *spans;
    Py_ssize_t n_spans;
    PyObject *work;                    /* owned: dict */
    PyObject *reward;                  /* owned: float, or NULL */
    PyObject *temperature;             /* owned: float */
    PyObject *sampling;                /* owned: the record's sampling, as JSON */
    Py_ssize_t lp_first;               /* its first logprob among the page's */
    int lp_null;                       /* a logprob is not finite (JSON null) */
    Py_ssize_t rec_start, rec_end;     /* its record in the turns buffer */
    Py_ssize_t delta_at, delta_end, comp_at, comp_end;  /* its id items in the turns buffer */
} Turn;

typedef struct {
    PyObject *version;  /* owned: int */
    long long v;
    PyObject *path;     /* owned: str or None */
} PathEntry;

typedef struct {
    PyObject *chat_id, *user_id, *leaf;  /* borrowed */
    Py_ssize_t *turns;
    Py_ssize_t n_turns;
    PyObject *reward;                    /* owned float or NULL */
    int complete;
    PathEntry *paths;
    Py_ssize_t n_paths;
    PyObject *leaf_work;                 /* owned dict */
} Rollout;

typedef struct {
    Opts *o;
    Turn *turns;
    Py_ssize_t n_turns, cap_turns;
    Rollout *rollouts;
    Py_ssize_t n_rollouts, cap_rollouts;
    PyObject *index;     /* message id -> turn number (int), or None: the version filters leave it out */
    int malformed;       /* a page the Python builder takes */
} Page;

static void page_free(Page *p) {
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
            Py_XDECREF(r->paths[j].version);
            Py_XDECREF(r->paths[j].path);
        }
        PyMem_Free(r->paths);
        Py_XDECREF(r->leaf_work);
    }
    PyMem_Free(p->rollouts);
    Py_XDECREF(p->index);
}

/* a row's field (new reference) */
static PyObject *field(PyObject *row, Py_ssize_t i) {
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

static long long le32(const char *p) {
    const unsigned char *u = (const unsigned char *)p;
    return (int32_t)((uint32_t)u[0] | (uint32_t)u[1] << 8 | (uint32_t)u[2] << 16 | (uint32_t)u[3] << 24);
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

/* the turn's sampling (its work's sampling parameters with its seed) as JSON, and its temperature (1.0
 * where the parameters have none): once per distinct work text. 0, -1 error, 1 not a shape taken here */
static int read_sampling(Opts *o, PyObject *raw, Turn *t) {
    PyObject *known = PyDict_GetItemWithError(o->samplings, raw);
    if (!known && PyErr_Occurred()) PyErr_Clear();  /* unhashable: made each time */
    if (known) {
        t->sampling = PyTuple_GET_ITEM(known, 0);
        t->temperature = PyTuple_GET_ITEM(known, 1);
        Py_INCREF(t->sampling);
        Py_INCREF(t->temperature);
        return 0;
    }
    PyObject *params = get(t->work, K_SAMPLING);
    int truth = PyObject_IsTrue(params);
    if (truth < 0) return -1;
    if (truth && !PyDict_Check(params)) return 1;
    PyObject *sampling = truth ? PyDict_Copy(params) : PyDict_New();
    if (!sampling) return -1;
    if (PyDict_SetItem(sampling, K_SEED, get(t->work, K_SEED)) < 0) {
        Py_DECREF(sampling);
        return -1;
    }
    PyObject *temp = get(sampling, K_TEMPERATURE);
    t->temperature = temp == Py_None ? PyFloat_FromDouble(1.0) : PyNumber_Float(temp);
    Buf text = {0};
    int rc = t->temperature ? buf_value(&text, o, sampling) : -1;
    Py_DECREF(sampling);
    if (rc == 0) t->sampling = PyBytes_FromStringAndSize(text.data ? text.data : "", text.len);
    PyMem_Free(text.data);
    if (rc < 0 || !t->sampling) return -1;
    PyObject *entry = PyTuple_Pack(2, t->sampling, t->temperature);
    if (!entry) return -1;
    rc = PyDict_SetItem(o->samplings, raw, entry);
    Py_DECREF(entry);
    if (rc < 0) PyErr_Clear();  /* (unhashable: not kept) */
    return 0;
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
    tu->work = read_work(o, raw);
    if (tu->work && tu->work != Py_None) rc = read_sampling(o, raw, tu);
    Py_DECREF(raw);
    if (!tu->work) return -2;
    if (tu->work == Py_None) return -3;
    if (rc) return rc < 0 ? -2 : -3;
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
    r->paths[r->n_paths].version = NULL;
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
    if (last->msg == leaf) {
        Py_INCREF(last->work);
        r->leaf_work = last->work;
    } else {
        PyObject *raw = field(leaf, M_WORK);
        if (!raw) goto done;
        r->leaf_work = read_work(o, raw);
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
static int add_chat(Page *p, PyObject *chat) {
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

/* --- writing ----------------------------------------------------------------------------------------- */

/* int32 items of a packed blob, from item a to b, after ``*first`` */
static int buf_ids(Buf *b, PyObject *blob, Py_ssize_t a, Py_ssize_t e, int *first) {
    if (e <= a) return 0;
    if (buf_reserve(b, (e - a) * 12) < 0) return -1;
    const char *s = PyBytes_AS_STRING(blob);
    char *out = b->data + b->len;
    for (Py_ssize_t i = a; i < e; i++) {
        if (!*first) *out++ = ',';
        *first = 0;
        out += fmt_ll(out, le32(s + 4 * i));
    }
    b->len = out - b->data;
    return 0;
}

typedef struct {
    PyObject *text;     /* the page's logprobs as one JSON array */
    Py_ssize_t *at;     /* item i is text[at[i] : at[i + 1] - 1] */
    Py_ssize_t n;
} Floats;

static int page_floats(Page *p, Floats *f) {
    Py_ssize_t total = 0;
    for (Py_ssize_t k = 0; k < p->n_turns; k++) {
        p->turns[k].lp_first = total;
        total += p->turns[k].n_completion;
    }
    PyObject *blob = PyBytes_FromStringAndSize(NULL, total * 4);
    if (!blob) return -1;
    char *dst = PyBytes_AS_STRING(blob);
    for (Py_ssize_t k = 0; k < p->n_turns; k++) {
        Py_ssize_t len = PyBytes_GET_SIZE(p->turns[k].logprobs);
        memcpy(dst, PyBytes_AS_STRING(p->turns[k].logprobs), (size_t)len);
        dst += len;
    }
    f->text = PyObject_CallOneArg(p->o->floats, blob);
    Py_DECREF(blob);
    if (!f->text) return -1;
    if (!PyBytes_Check(f->text)) {
        PyErr_SetString(PyExc_TypeError, "floats did not return bytes");
        return -1;
    }
    f->at = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(total + 1));
    if (!f->at) {
        PyErr_NoMemory();
        return -1;
    }
    const char *s = PyBytes_AS_STRING(f->text);
    Py_ssize_t len = PyBytes_GET_SIZE(f->text), n = 0;
    if (len < 2 || s[0] != '[' || s[len - 1] != ']') goto bad;
    if (total) {
        f->at[n++] = 1;
        for (Py_ssize_t i = 1; i < len - 1; i++) {
            if (s[i] == ',') {
                if (n > total) goto bad;
                f->at[n++] = i + 1;
            }
        }
        if (n != total) goto bad;
        f->at[n] = len;  /* one past the closing bracket: item n - 1 ends at len - 1 */
    } else if (len != 2) goto bad;
    f->n = total;
    for (Py_ssize_t k = 0; k < p->n_turns; k++) {
        Turn *t = &p->turns[k];
        for (Py_ssize_t i = t->lp_first; i < t->lp_first + t->n_completion; i++) {
            if (s[f->at[i]] == 'n') {
                t->lp_null = 1;
                break;
            }
        }
    }
    return 0;
bad:
    PyErr_SetString(PyExc_ValueError, "floats: not a JSON array of the page's logprobs");
    return -1;
}

/* the turn's logprob items, as a record has them (null) or a sample (0.0 for null), after ``*first`` */
static int buf_logprobs(Buf *b, Floats *f, Turn *t, int zeroed, int *first) {
    if (!t->n_completion) return 0;
    const char *s = PyBytes_AS_STRING(f->text);
    Py_ssize_t a = f->at[t->lp_first], e = f->at[t->lp_first + t->n_completion] - 1;
    if (!*first && buf_char(b, ',') < 0) return -1;
    *first = 0;
    if (!zeroed || !t->lp_null) return buf_put(b, s + a, e - a);
    for (Py_ssize_t i = t->lp_first; i < t->lp_first + t->n_completion; i++) {
        if (i > t->lp_first && buf_char(b, ',') < 0) return -1;
        Py_ssize_t x = f->at[i], y = f->at[i + 1] - 1;
        if (s[x] == 'n' ? PUT_LIT(b, "0.0") : buf_put(b, s + x, y - x)) return -1;
    }
    return 0;
}

static int buf_float(Buf *b, Opts *o, PyObject *x) {
    return x ? buf_value(b, o, x) : PUT_LIT(b, "null");
}

static int buf_stop(Buf *b, Opts *o, PyObject *raw) {
    if (raw == Py_None) return PUT_LIT(b, "null");
    PyObject *text = PyDict_GetItemWithError(o->stop_cache, raw);
    if (text) return buf_put(b, PyBytes_AS_STRING(text), PyBytes_GET_SIZE(text));
    if (PyErr_Occurred()) return -1;
    PyObject *value = PyObject_CallOneArg(o->stop_reason, raw);
    if (!value) return -1;
    Buf one = {0};
    int rc = buf_value(&one, o, value);
    Py_DECREF(value);
    if (rc == 0) {
        text = PyBytes_FromStringAndSize(one.data, one.len);
        rc = text ? buf_put(b, one.data, one.len) : -1;
        if (text && PyDict_GET_SIZE(o->stop_cache) < 4096 && PyDict_SetItem(o->stop_cache, raw, text) < 0) rc = -1;
        Py_XDECREF(text);
    }
    PyMem_Free(one.data);
    return rc;
}

/* ``created_texts``: SQLite's stored text to isoformat's, else the caller's conversion */
static int buf_created(Buf *b, Opts *o, PyObject *raw) {
    if (PyUnicode_CheckExact(raw)) {
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(raw, &n);
        if (!s) return -1;
        int plain = n == 26;  /* (ASCII with nothing to escape, so that 26 bytes are 26 characters) */
        for (Py_ssize_t i = 0; plain && i < n; i++) plain = s[i] >= 0x20 && s[i] < 0x7f && s[i] != '"' && s[i] != '\\';
        if (plain && s[10] == ' ' && s[19] == '.' && memcmp(s + 20, "000000", 6) != 0) {
            if (buf_reserve(b, 28) < 0) return -1;
            char *p = b->data + b->len;
            *p++ = '"';
            memcpy(p, s, 10);
            p[10] = 'T';
            memcpy(p + 11, s + 11, 15);
            p[26] = '"';
            b->len += 28;
            return 0;
        }
    }
    PyObject *text = PyObject_CallOneArg(o->created, raw);
    if (!text) return -1;
    int rc = buf_value(b, o, text);
    Py_DECREF(text);
    return rc;
}

static int put_field(Buf *b, Opts *o, const char *key_lit, Py_ssize_t key_len, PyObject *row, Py_ssize_t i) {
    if (buf_put(b, key_lit, key_len) < 0) return -1;
    PyObject *v = field(row, i);
    if (!v) return -1;
    int rc = buf_value(b, o, v);
    Py_DECREF(v);
    return rc;
}

#define PUT_FIELD(b, o, key, row, i) put_field((b), (o), (key), (Py_ssize_t)(sizeof(key) - 1), (row), (i))

/* a dict's value (borrowed; Py_None where absent) */
static PyObject *get(PyObject *dict, PyObject *key) {
    PyObject *v = PyDict_GetItemWithError(dict, key);
    if (!v) PyErr_Clear();  /* (an unhashable key cannot be one of these) */
    return v ? v : Py_None;
}

/* the turn's record (``_turn_records``) into the turns buffer */
static int write_turn(Buf *b, Opts *o, Floats *f, Turn *t) {
    PyObject *m = t->msg, *tok = t->tok, *v;
    int first;
    t->rec_start = b->len;
    if (PUT_FIELD(b, o, "{\"message_id\":", m, M_ID) < 0) return -1;
    if (PUT_LIT(b, ",\"prompt_delta_ids\":[") < 0) return -1;
    t->delta_at = b->len;
    first = 1;
    if (buf_ids(b, t->prompt, t->prev_len, t->n_prompt, &first) < 0) return -1;
    t->delta_end = b->len;
    if (PUT_LIT(b, "],\"completion_ids\":[") < 0) return -1;
    t->comp_at = b->len;
    first = 1;
    if (buf_ids(b, t->completion, 0, t->n_completion, &first) < 0) return -1;
    t->comp_end = b->len;
    if (PUT_LIT(b, "],\"logprobs\":[") < 0) return -1;
    first = 1;
    if (buf_logprobs(b, f, t, 0, &first) < 0) return -1;
    if (PUT_LIT(b, "]") < 0 || PUT_FIELD(b, o, ",\"finish_reason\":", tok, T_FINISH) < 0) return -1;
    if (PUT_LIT(b, ",\"stop_reason\":") < 0 || !(v = field(tok, T_STOP))) return -1;
    int rc = buf_stop(b, o, v);
    Py_DECREF(v);
    if (rc < 0 || PUT_LIT(b, ",\"synthetic_closer_ids\":[") < 0) return -1;
    PyObject *reused = field(tok, T_REUSED), *synth = field(tok, T_SYNTH);
    if (!reused || !synth) {
        Py_XDECREF(reused);
        Py_XDECREF(synth);
        return -1;
    }
    int truth = PyObject_IsTrue(synth);
    if (truth > 0) {
        long long a = PyLong_AsLongLong(reused), n = PyLong_AsLongLong(synth);
        if (PyErr_Occurred()) truth = -1;
        else {
            long long e = a + n;
            if (a > t->n_prompt) a = t->n_prompt;
            if (e > t->n_prompt) e = t->n_prompt;
            first = 1;
            if (buf_ids(b, t->prompt, (Py_ssize_t)a, (Py_ssize_t)e, &first) < 0) truth = -1;
        }
    }
    Py_DECREF(synth);
    if (truth < 0 || PUT_LIT(b, "],\"reused_prefix_len\":") < 0 || buf_value(b, o, reused) < 0) {
        Py_DECREF(reused);
        return -1;
    }
    Py_DECREF(reused);
    if (PUT_LIT(b, ",\"fork\":") < 0 || !(v = field(tok, T_FORK))) return -1;
    rc = buf_bool(b, v);
    Py_DECREF(v);
    if (rc < 0 || PUT_FIELD(b, o, ",\"prompt_method\":", tok, T_METHOD) < 0) return -1;
    if (PUT_LIT(b, ",\"prompt_length\":") < 0 || buf_ll(b, t->n_prompt) < 0) return -1;
    if (PUT_LIT(b, ",\"sampling\":") < 0 ||
        buf_put(b, PyBytes_AS_STRING(t->sampling), PyBytes_GET_SIZE(t->sampling)) < 0)
        return -1;
    if (PUT_LIT(b, ",\"reward\":") < 0 || buf_float(b, o, t->reward) < 0) return -1;
    if (PUT_LIT(b, ",\"done\":") < 0 || !(v = field(m, M_DONE))) return -1;
    rc = buf_bool(b, v);
    Py_DECREF(v);
    if (rc < 0 || PUT_LIT(b, ",\"policy_versions\":[") < 0) return -1;
    for (Py_ssize_t i = 0; i < t->n_spans; i++) {
        if ((i && buf_char(b, ',') < 0) || buf_char(b, '[') < 0 || buf_ll(b, t->spans[i].start) < 0 ||
            buf_char(b, ',') < 0 || buf_ll(b, t->spans[i].version) < 0 || buf_char(b, ']') < 0)
            return -1;
    }
    if (PUT_LIT(b, "]") < 0 || PUT_FIELD(b, o, ",\"content\":", m, M_CONTENT) < 0 ||
        PUT_FIELD(b, o, ",\"reasoning_content\":", m, M_REASONING) < 0)
        return -1;
    if (PUT_LIT(b, ",\"tool_calls\":") < 0 || !(v = field(m, M_TOOL_CALLS))) return -1;
    PyObject *calls = decode(o, v);
    Py_DECREF(v);
    if (!calls) return -1;
    rc = buf_value(b, o, calls);
    Py_DECREF(calls);
    if (rc < 0 || PUT_LIT(b, ",\"created_at\":") < 0 || !(v = field(m, M_CREATED))) return -1;
    rc = buf_created(b, o, v);
    Py_DECREF(v);
    if (rc < 0 || buf_char(b, '}') < 0) return -1;
    t->rec_end = b->len;
    return 0;
}

/* the versions of a turn's n completion tokens (``token_versions``), after ``*first`` */
static int buf_versions(Buf *b, Turn *t, int *first) {
    Py_ssize_t n = t->n_completion;
    if (!n) return 0;
    char item[24];
    if (t->n_spans == 1 && !t->spans[0].start) {  /* one version for the whole completion: the usual case */
        int len = fmt_ll(item, t->spans[0].version);
        return buf_repeat(b, item, len, n, first);
    }
    /* as token_versions: NO_VERSION everywhere, then each span's version from its start to the next's */
    long long *out = PyMem_Malloc(sizeof(long long) * (size_t)n);
    if (!out) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) out[i] = -1;
    for (Py_ssize_t k = 0; k < t->n_spans; k++) {
        long long a = t->spans[k].start < 0 ? 0 : t->spans[k].start;
        long long e = k + 1 < t->n_spans ? t->spans[k + 1].start : n;
        if (e > n) e = n;
        for (long long i = a; i < e; i++) out[i] = t->spans[k].version;
    }
    int rc = 0;
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) rc = buf_repeat(b, item, fmt_ll(item, out[i]), 1, first);
    PyMem_Free(out);
    return rc;
}

/* the rollout's line (``page_lines``) */
static int write_rollout(Buf *b, Page *p, Floats *f, Buf *turns_buf, Rollout *r) {
    Opts *o = p->o;
    PyObject *v;
    Turn *head = &p->turns[r->turns[0]];
    if (buf_put(b, PyBytes_AS_STRING(o->head), PyBytes_GET_SIZE(o->head)) < 0) return -1;
    if (PUT_FIELD(b, o, ",\"rollout_id\":", r->leaf, M_ID) < 0) return -1;
    if (PUT_LIT(b, ",\"chat_id\":") < 0 || buf_value(b, o, r->chat_id) < 0) return -1;
    if (PUT_FIELD(b, o, ",\"leaf_message_id\":", r->leaf, M_ID) < 0) return -1;
    if (PUT_LIT(b, ",\"user_id\":") < 0 || buf_value(b, o, r->user_id) < 0) return -1;
    if (PUT_LIT(b, ",\"model_name\":") < 0 || !(v = field(r->leaf, M_MODEL))) return -1;
    int truth = PyObject_IsTrue(v);
    int rc = truth < 0 ? -1 : truth ? buf_value(b, o, v) : PUT_LIT(b, "\"\"");
    Py_DECREF(v);
    if (rc < 0) return -1;
    if (PUT_FIELD(b, o, ",\"tokenizer_hash\":", head->tok, T_TOKENIZER) < 0 ||
        PUT_FIELD(b, o, ",\"template_hash\":", head->tok, T_TEMPLATE) < 0 ||
        PUT_FIELD(b, o, ",\"engine\":", head->tok, T_ENGINE) < 0)
        return -1;
    if (PUT_LIT(b, ",\"system_prompt\":") < 0 || buf_value(b, o, get(r->leaf_work, K_SYSTEM_PROMPT)) < 0) return -1;
    if (PUT_LIT(b, ",\"tools\":") < 0 || buf_value(b, o, get(r->leaf_work, K_TOOLS)) < 0) return -1;
    if (PUT_LIT(b, ",\"turns\":[") < 0) return -1;
    for (Py_ssize_t i = 0; i < r->n_turns; i++) {
        Turn *t = &p->turns[r->turns[i]];
        if ((i && buf_char(b, ',') < 0) || buf_put(b, turns_buf->data + t->rec_start, t->rec_end - t->rec_start) < 0)
            return -1;
    }
    if (PUT_LIT(b, "],\"samples\":[") < 0) return -1;
    /* samples: runs of turns each extending the one before */
    Py_ssize_t g = 0;
    while (g < r->n_turns) {
        Py_ssize_t e = g + 1;
        while (e < r->n_turns && p->turns[r->turns[e]].extends) e++;
        int first;
        if (g && buf_char(b, ',') < 0) return -1;
        if (PUT_LIT(b, "{\"token_ids\":[") < 0) return -1;
        first = 1;
        for (Py_ssize_t i = g; i < e; i++) {
            Turn *t = &p->turns[r->turns[i]];
            if (t->delta_end > t->delta_at) {
                if ((!first && buf_char(b, ',') < 0) ||
                    buf_put(b, turns_buf->data + t->delta_at, t->delta_end - t->delta_at) < 0)
                    return -1;
                first = 0;
            }
            if (t->comp_end > t->comp_at) {
                if ((!first && buf_char(b, ',') < 0) ||
                    buf_put(b, turns_buf->data + t->comp_at, t->comp_end - t->comp_at) < 0)
                    return -1;
                first = 0;
            }
        }
        if (PUT_LIT(b, "],\"loss_mask\":[") < 0) return -1;
        first = 1;
        for (Py_ssize_t i = g; i < e; i++) {
            Turn *t = &p->turns[r->turns[i]];
            if (buf_repeat(b, "0", 1, t->n_prompt - t->prev_len, &first) < 0 ||
                buf_repeat(b, "1", 1, t->n_completion, &first) < 0)
                return -1;
        }
        if (PUT_LIT(b, "],\"logprobs\":[") < 0) return -1;
        first = 1;
        for (Py_ssize_t i = g; i < e; i++) {
            Turn *t = &p->turns[r->turns[i]];
            if (buf_repeat(b, "0.0", 3, t->n_prompt - t->prev_len, &first) < 0 ||
                buf_logprobs(b, f, t, 1, &first) < 0)
                return -1;
        }
        Turn *g0 = &p->turns[r->turns[g]];
        if (PUT_LIT(b, "],\"prompt_length\":") < 0 || buf_ll(b, g0->n_prompt - g0->prev_len) < 0) return -1;
        if (PUT_LIT(b, ",\"turn_spans\":[") < 0) return -1;
        Py_ssize_t end = 0;
        for (Py_ssize_t i = g; i < e; i++) {
            Turn *t = &p->turns[r->turns[i]];
            Py_ssize_t start = end + (t->n_prompt - t->prev_len);
            end = start + t->n_completion;
            if ((i > g && buf_char(b, ',') < 0) || buf_char(b, '[') < 0 || buf_ll(b, start) < 0 ||
                buf_char(b, ',') < 0 || buf_ll(b, end) < 0 || buf_char(b, ']') < 0)
                return -1;
        }
        if (PUT_LIT(b, "],\"turn_indices\":[") < 0) return -1;
        for (Py_ssize_t i = g; i < e; i++)
            if ((i > g && buf_char(b, ',') < 0) || buf_ll(b, i) < 0) return -1;
        if (PUT_LIT(b, "],\"temperatures\":[") < 0) return -1;
        for (Py_ssize_t i = g; i < e; i++)
            if ((i > g && buf_char(b, ',') < 0) || buf_value(b, o, p->turns[r->turns[i]].temperature) < 0) return -1;
        if (PUT_LIT(b, "],\"policy_versions\":[") < 0) return -1;
        first = 1;
        for (Py_ssize_t i = g; i < e; i++) {
            Turn *t = &p->turns[r->turns[i]];
            if (buf_repeat(b, "-1", 2, t->n_prompt - t->prev_len, &first) < 0 || buf_versions(b, t, &first) < 0)
                return -1;
        }
        if (PUT_LIT(b, "]}") < 0) return -1;
        g = e;
    }
    if (PUT_LIT(b, "],\"reward\":") < 0 || buf_float(b, o, r->reward) < 0) return -1;
    if (PUT_LIT(b, ",\"reward_rule\":") < 0 ||
        buf_put(b, PyBytes_AS_STRING(o->rule_text), PyBytes_GET_SIZE(o->rule_text)) < 0)
        return -1;
    if (PUT_LIT(b, ",\"complete\":") < 0 || (r->complete ? PUT_LIT(b, "true") : PUT_LIT(b, "false")) < 0) return -1;
    if (PUT_LIT(b, ",\"policy_paths\":{") < 0) return -1;
    for (Py_ssize_t j = 0; j < r->n_paths; j++) {
        if ((j && buf_char(b, ',') < 0) || buf_char(b, '"') < 0 || buf_ll(b, r->paths[j].v) < 0 ||
            PUT_LIT(b, "\":") < 0 || buf_value(b, o, r->paths[j].path) < 0)
            return -1;
    }
    return PUT_LIT(b, "}}\n");
}

static Buf KEPT_TURNS, KEPT_OUT;

static void keep(Buf *kept, Buf *b) {
    if (!kept->data && b->cap <= (64 << 20)) *kept = *b;
    else PyMem_Free(b->data);
}

static PyObject *encode_page(PyObject *self, PyObject *args) {
    PyObject *chats, *min_score;
    const char *rule;
    Opts o = {0};
    if (!PyArg_ParseTuple(args, "OppsOOOOOOOOOOSO!", &chats, &o.rated_only, &o.include_incomplete, &rule,
                          &min_score, &o.leaf_passes, &o.recent_enough, &o.path, &o.json, &o.created,
                          &o.stop_reason, &o.dumps, &o.floats, &o.head, &o.rule_text, &PyDict_Type,
                          &o.stop_cache))
        return NULL;
    if (!strcmp(rule, "last")) o.rule = RULE_LAST;
    else if (!strcmp(rule, "mean")) o.rule = RULE_MEAN;
    else if (!strcmp(rule, "min")) o.rule = RULE_MIN;
    else if (!strcmp(rule, "leaf")) o.rule = RULE_LEAF;
    else return PyErr_Format(PyExc_ValueError, "unknown reward rule %s", rule);
    if (min_score != Py_None) {
        o.has_min_score = 1;
        o.min_score = PyFloat_AsDouble(min_score);
        if (o.min_score == -1.0 && PyErr_Occurred()) return NULL;
    }
    PyObject *seq = PySequence_Fast(chats, "chats");
    if (!seq) return NULL;
    Page p = {0};
    p.o = &o;
    Floats f = {0};
    /* the buffers of the last call, taken (and given back at the end): fresh memory for each page
     * costs more in page faults than filling it */
    Buf turns_buf = KEPT_TURNS, out = KEPT_OUT;
    KEPT_TURNS = KEPT_OUT = (Buf){0};
    turns_buf.len = out.len = 0;
    PyObject *result = NULL;
    int rc = 0;
    if (!(p.index = PyDict_New()) || !(o.decoded = PyDict_New()) || !(o.samplings = PyDict_New())) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) rc = add_chat(&p, PySequence_Fast_GET_ITEM(seq, i));
    if (rc == -1) goto done;
    if (rc) {  /* malformed: the Python builder */
        Py_INCREF(Py_None);
        result = Py_None;
        goto done;
    }
    if (page_floats(&p, &f) < 0) goto done;
    /* room for the records and lines, roughly, so that the buffers are not copied as they grow */
    Py_ssize_t items = 0;
    for (Py_ssize_t k = 0; k < p.n_turns; k++) items += p.turns[k].n_prompt + 2 * p.turns[k].n_completion;
    if (buf_reserve(&turns_buf, PyBytes_GET_SIZE(f.text) + items * 7 + p.n_turns * 1024) < 0 ||
        buf_reserve(&out, 2 * turns_buf.cap + p.n_rollouts * 1024) < 0)
        goto done;
    for (Py_ssize_t k = 0; k < p.n_turns; k++)
        if (write_turn(&turns_buf, &o, &f, &p.turns[k]) < 0) goto done;
    for (Py_ssize_t i = 0; i < p.n_rollouts; i++)
        if (write_rollout(&out, &p, &f, &turns_buf, &p.rollouts[i]) < 0) goto done;
    PyObject *text = PyBytes_FromStringAndSize(out.data ? out.data : "", out.len);
    if (text) {
        result = Py_BuildValue("(Nn)", text, p.n_rollouts);
    }
done:
    page_free(&p);
    Py_XDECREF(o.decoded);
    Py_XDECREF(o.samplings);
    Py_XDECREF(f.text);
    PyMem_Free(f.at);
    keep(&KEPT_TURNS, &turns_buf);
    keep(&KEPT_OUT, &out);
    Py_DECREF(seq);
    return result;
}

static PyMethodDef methods[] = {
    {"encode_page", encode_page, METH_VARARGS,
     "encode_page(chats, rated_only, include_incomplete, reward_rule, min_score, leaf_passes, recent_enough, "
     "path, json, created, stop_reason, dumps, floats, head, rule_text, stop_cache) -> (bytes, rollouts) | None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastpage", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fastpage(void) {
    K_SAMPLING = PyUnicode_InternFromString("sampling_parameters");
    K_SEED = PyUnicode_InternFromString("seed");
    K_TEMPERATURE = PyUnicode_InternFromString("temperature");
    K_SYSTEM_PROMPT = PyUnicode_InternFromString("system_prompt");
    K_TOOLS = PyUnicode_InternFromString("tools");
    PyObject *builtins = PyEval_GetBuiltins();  /* borrowed */
    SUM = builtins ? PyDict_GetItemString(builtins, "sum") : NULL;
    if (!K_SAMPLING || !K_SEED || !K_TEMPERATURE || !K_SYSTEM_PROMPT || !K_TOOLS || !SUM) return NULL;
    Py_INCREF(SUM);
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "M_COUNT", M_COUNT) < 0 || PyModule_AddIntConstant(m, "T_COUNT", T_COUNT) < 0 ||
        PyModule_AddIntConstant(m, "M_DONE", M_DONE) < 0 || PyModule_AddIntConstant(m, "T_METHOD", T_METHOD) < 0 ||
        PyModule_AddIntConstant(m, "M_ID", M_ID) < 0 || PyModule_AddIntConstant(m, "M_POLICY", M_POLICY) < 0 ||
        PyModule_AddIntConstant(m, "T_SYNTH", T_SYNTH) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
