/* A built page as the buffers of Arrow columns (page_cols.h): the values ``page_batch``
 * (server/export/columnar.py) puts in its record batch, which server/export/fastpage.py assembles
 * (``pa.Array.from_buffers``), a list's items under ``name.items``. Turns are written per rollout in its
 * order (a turn that branches share repeats, as in ``page_batch``).
 */
#include <math.h>

#include "page_cols.h"

const char *const COL_NAMES[N_COLS] = {
    "rollout_id", "chat_id", "leaf_message_id", "user_id", "model_name", "tokenizer_hash", "template_hash",
    "engine", "system_prompt", "tools", "reward", "complete", "policy_paths", "turns", "samples",
    "turns.message_id", "turns.prompt_delta_ids", "turns.prompt_delta_ids.items", "turns.completion_ids",
    "turns.completion_ids.items", "turns.logprobs", "turns.logprobs.items", "turns.finish_reason",
    "turns.stop_reason", "turns.synthetic_closer_ids", "turns.synthetic_closer_ids.items",
    "turns.reused_prefix_len", "turns.fork", "turns.prompt_method", "turns.prompt_length", "turns.sampling",
    "turns.reward", "turns.done", "turns.policy_versions", "turns.policy_versions.items",
    "turns.policy_versions.items.items", "turns.content", "turns.reasoning_content", "turns.tool_calls",
    "turns.created_at",
    "samples.token_ids", "samples.token_ids.items", "samples.loss_mask", "samples.loss_mask.items",
    "samples.logprobs", "samples.logprobs.items", "samples.prompt_length", "samples.turn_spans",
    "samples.turn_spans.items", "samples.turn_spans.items.items", "samples.turn_indices",
    "samples.turn_indices.items", "samples.temperatures", "samples.temperatures.items",
    "samples.policy_versions", "samples.policy_versions.items",
};

/* a row's validity: the byte array is made at the first null (every row before it valid) */
static int col_valid(Col *c, int valid) {
    if (!valid && !c->nulls) {
        if (buf_reserve(&c->valid, c->rows + 1) < 0) return -1;
        memset(c->valid.data, 1, (size_t)c->rows);
        c->valid.len = c->rows;
    }
    if (!valid) c->nulls++;
    if (c->nulls && buf_char(&c->valid, (char)valid) < 0) return -1;
    c->rows++;
    return 0;
}

static int col_raw(Col *c, const void *v, Py_ssize_t size, int valid) {
    if (buf_put(&c->values, (const char *)v, size) < 0) return -1;
    return col_valid(c, valid);
}

static int col_i64(Col *c, long long v) { return col_raw(c, &v, 8, 1); }
static int col_i32(Col *c, int32_t v) { return col_raw(c, &v, 4, 1); }
static int col_f64(Col *c, double v) { return col_raw(c, &v, 8, 1); }
static int col_bool(Col *c, int v) {
    char b = (char)(v != 0);
    return col_raw(c, &b, 1, 1);
}

/* a list column's row: its length */
static int col_len(Col *c, Py_ssize_t n) { return col_i32(c, (int32_t)n); }

/* a string row is its text written into ``values`` between these two */
static int str_begin(Col *c) {
    return !c->offsets.len && buf_put(&c->offsets, "\0\0\0\0", 4) < 0 ? -1 : 0;
}

static int str_end(Col *c, int valid) {
    int32_t end = (int32_t)c->values.len;
    if (buf_put(&c->offsets, (const char *)&end, 4) < 0) return -1;
    return col_valid(c, valid);
}

static int col_str(Col *c, const char *s, Py_ssize_t n, int valid) {
    if (str_begin(c) < 0 || buf_put(&c->values, s, n) < 0) return -1;
    return str_end(c, valid);
}

/* a str (None: null) into a string column: 0, -1 error, -3 a value of another type (the Python path) */
static int col_str_obj(Col *c, PyObject *v) {
    if (v == Py_None) return col_str(c, "", 0, 0);
    if (PyBytes_CheckExact(v)) return col_str(c, PyBytes_AS_STRING(v), PyBytes_GET_SIZE(v), 1);
    if (!PyUnicode_CheckExact(v)) return -3;
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(v, &n);
    return s ? col_str(c, s, n, 1) : -1;
}

static int col_field_str(Col *c, PyObject *row, Py_ssize_t i) {
    PyObject *v = field(row, i);
    if (!v) return -1;
    int rc = col_str_obj(c, v);
    Py_DECREF(v);
    return rc;
}

/* a value's JSON text (orjson's) into a string column */
static int col_json(Col *c, Opts *o, PyObject *v) {
    if (str_begin(c) < 0 || buf_value(&c->values, o, v) < 0) return -1;
    return str_end(c, 1);
}

/* an int (None: null) into an int64 column */
static int col_i64_obj(Col *c, PyObject *v) {
    if (v == Py_None) return col_raw(c, "\0\0\0\0\0\0\0\0", 8, 0);
    if (!PyLong_CheckExact(v)) return -3;
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    return col_i64(c, x);
}

static int col_f64_obj(Col *c, PyObject *v) {
    if (!v || v == Py_None) return col_raw(c, "\0\0\0\0\0\0\0\0", 8, 0);
    double x = PyFloat_AsDouble(v);
    if (x == -1.0 && PyErr_Occurred()) return -1;
    return col_f64(c, x);
}

static int col_truth(Col *c, PyObject *row, Py_ssize_t i) {
    PyObject *v = field(row, i);
    if (!v) return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t < 0 ? -1 : col_bool(c, t);
}

/* ``created_texts``' value: SQLite's stored text in isoformat's form, else the caller's conversion */
static int col_created(Col *c, Opts *o, PyObject *raw) {
    char iso[CREATED_MAX];
    int plain = plain_created(o, raw, iso);
    if (plain) return plain < 0 ? -1 : col_str(c, iso, plain, 1);
    PyObject *text = created_text(o, raw);
    if (!text) return -1;
    int rc = col_str_obj(c, text);
    Py_DECREF(text);
    return rc;
}

/* int32 items [a, e) of a packed blob */
static int put_ids(Col *c, PyObject *blob, Py_ssize_t a, Py_ssize_t e) {
    return e > a ? buf_put(&c->values, PyBytes_AS_STRING(blob) + 4 * a, 4 * (e - a)) : 0;
}

static int put_repeat_i32(Col *c, int32_t v, Py_ssize_t n) {
    if (n <= 0) return 0;
    if (buf_reserve(&c->values, 4 * n) < 0) return -1;
    int32_t *p = (int32_t *)(c->values.data + c->values.len);
    for (Py_ssize_t i = 0; i < n; i++) p[i] = v;
    c->values.len += 4 * n;
    return 0;
}

/* the turn's completion logprobs; sample: non-finite ones as 0 (no nulls), else null where not finite */
static int put_logprobs(Col *c, Turn *t, int sample) {
    Py_ssize_t n = t->n_completion;
    if (!n) return 0;
    if (buf_put(&c->values, PyBytes_AS_STRING(t->logprobs), 4 * n) < 0) return -1;
    float *x = (float *)(c->values.data + c->values.len - 4 * n);
    for (Py_ssize_t i = 0; i < n; i++) {
        int finite = isfinite(x[i]);
        if (sample) {
            if (!finite) x[i] = 0.0f;
        } else if (col_valid(c, finite) < 0) {  /* (every item a row: its validity) */
            return -1;
        }
    }
    return 0;
}

static int write_turn_cols(Col *c, Opts *o, Turn *t) {
    PyObject *m = t->msg, *tok = t->tok, *v;
    int rc;
    if ((rc = col_field_str(&c[U_MESSAGE_ID], m, M_ID))) return rc;
    if (col_len(&c[U_DELTA], t->n_prompt - t->prev_len) < 0 ||
        put_ids(&c[U_DELTA_ITEMS], t->prompt, t->prev_len, t->n_prompt) < 0)
        return -1;
    if (col_len(&c[U_COMPLETION], t->n_completion) < 0 ||
        put_ids(&c[U_COMPLETION_ITEMS], t->completion, 0, t->n_completion) < 0)
        return -1;
    if (col_len(&c[U_LOGPROBS], t->n_completion) < 0 || put_logprobs(&c[U_LOGPROBS_ITEMS], t, 0) < 0) return -1;
    if ((rc = col_field_str(&c[U_FINISH], tok, T_FINISH))) return rc;
    if (!(v = field(tok, T_STOP))) return -1;
    rc = str_begin(&c[U_STOP]) < 0 || buf_stop(&c[U_STOP].values, o, v) < 0 || str_end(&c[U_STOP], 1) < 0 ? -1 : 0;
    Py_DECREF(v);
    if (rc < 0) return -1;
    /* the closer: prompt[reused : reused + synth] where synth (both non-negative ints: add_turn) */
    PyObject *reused = field(tok, T_REUSED), *synth = field(tok, T_SYNTH);
    if (!reused || !synth) {
        Py_XDECREF(reused);
        Py_XDECREF(synth);
        return -1;
    }
    long long a = PyLong_AsLongLong(reused), e = a + PyLong_AsLongLong(synth);
    int has = PyObject_IsTrue(synth);
    Py_DECREF(synth);
    if (a > t->n_prompt) a = t->n_prompt;
    if (e > t->n_prompt) e = t->n_prompt;
    if (!has) a = e = 0;
    rc = col_len(&c[U_CLOSER], e > a ? e - a : 0) < 0 || put_ids(&c[U_CLOSER_ITEMS], t->prompt, a, e) < 0 ? -1 : 0;
    if (rc == 0) rc = col_i64_obj(&c[U_REUSED], reused);
    Py_DECREF(reused);
    if (rc) return rc;
    if (col_truth(&c[U_FORK], tok, T_FORK) < 0) return -1;
    if ((rc = col_field_str(&c[U_METHOD], tok, T_METHOD))) return rc;
    if (col_i64(&c[U_PROMPT_LENGTH], t->n_prompt) < 0) return -1;
    if (col_str(&c[U_SAMPLING], PyBytes_AS_STRING(t->sampling), PyBytes_GET_SIZE(t->sampling), 1) < 0) return -1;
    if (col_f64_obj(&c[U_REWARD], t->reward) < 0) return -1;
    if (col_truth(&c[U_DONE], m, M_DONE) < 0) return -1;
    if (col_len(&c[U_VERSIONS], t->n_spans) < 0) return -1;
    for (Py_ssize_t i = 0; i < t->n_spans; i++)
        if (col_len(&c[U_VERSIONS_SPANS], 2) < 0 || col_i64(&c[U_VERSIONS_ITEMS], t->spans[i].start) < 0 ||
            col_i64(&c[U_VERSIONS_ITEMS], t->spans[i].version) < 0)
            return -1;
    if ((rc = col_field_str(&c[U_CONTENT], m, M_CONTENT)) || (rc = col_field_str(&c[U_REASONING], m, M_REASONING)))
        return rc;
    if (!(v = field(m, M_TOOL_CALLS))) return -1;
    PyObject *calls = decode(o, v);
    Py_DECREF(v);
    if (!calls) return -1;
    rc = col_json(&c[U_TOOL_CALLS], o, calls);
    Py_DECREF(calls);
    if (rc) return rc;
    if (!(v = field(m, M_CREATED))) return -1;
    rc = col_created(&c[U_CREATED], o, v);
    Py_DECREF(v);
    return rc;
}

static int write_sample_cols(Col *c, Page *p, Rollout *r, Py_ssize_t g, Py_ssize_t e) {
    Py_ssize_t len = 0;
    for (Py_ssize_t i = g; i < e; i++) len += p->turns[r->turns[i]].n_prompt - p->turns[r->turns[i]].prev_len +
                                              p->turns[r->turns[i]].n_completion;
    if (col_len(&c[S_IDS], len) < 0 || col_len(&c[S_MASK], len) < 0 || col_len(&c[S_LOGPROBS], len) < 0 ||
        col_len(&c[S_VERSIONS], len) < 0 || col_len(&c[S_SPANS], e - g) < 0 || col_len(&c[S_INDICES], e - g) < 0 ||
        col_len(&c[S_TEMPERATURES], e - g) < 0)
        return -1;
    Py_ssize_t end = 0;
    for (Py_ssize_t i = g; i < e; i++) {
        Turn *t = &p->turns[r->turns[i]];
        Py_ssize_t nd = t->n_prompt - t->prev_len, nc = t->n_completion;
        if (put_ids(&c[S_IDS_ITEMS], t->prompt, t->prev_len, t->n_prompt) < 0 ||
            put_ids(&c[S_IDS_ITEMS], t->completion, 0, nc) < 0 || put_repeat_i32(&c[S_MASK_ITEMS], 0, nd) < 0 ||
            put_repeat_i32(&c[S_MASK_ITEMS], 1, nc) < 0 || put_repeat_i32(&c[S_LOGPROBS_ITEMS], 0, nd) < 0 ||
            put_logprobs(&c[S_LOGPROBS_ITEMS], t, 1) < 0 || put_repeat_i32(&c[S_VERSIONS_ITEMS], -1, nd) < 0)
            return -1;
        if (nc) {
            if (buf_reserve(&c[S_VERSIONS_ITEMS].values, 4 * nc) < 0) return -1;
            turn_versions(t, (int32_t *)(c[S_VERSIONS_ITEMS].values.data + c[S_VERSIONS_ITEMS].values.len));
            c[S_VERSIONS_ITEMS].values.len += 4 * nc;
        }
        Py_ssize_t start = end + nd;
        end = start + nc;
        if (i == g && col_i64(&c[S_PROMPT_LENGTH], start) < 0) return -1;
        if (col_len(&c[S_SPANS_PAIRS], 2) < 0 || col_i64(&c[S_SPANS_ITEMS], start) < 0 ||
            col_i64(&c[S_SPANS_ITEMS], end) < 0 || col_i64(&c[S_INDICES_ITEMS], i) < 0 ||
            col_f64_obj(&c[S_TEMPERATURES_ITEMS], t->temperature) < 0)
            return -1;
    }
    return 0;
}

static int write_rollout_cols(Col *c, Page *p, Rollout *r) {
    Opts *o = p->o;
    Turn *head = &p->turns[r->turns[0]];
    int rc;
    if ((rc = col_field_str(&c[R_ROLLOUT_ID], r->leaf, M_ID)) || (rc = col_str_obj(&c[R_CHAT_ID], r->chat_id)) ||
        (rc = col_field_str(&c[R_LEAF_ID], r->leaf, M_ID)) || (rc = col_str_obj(&c[R_USER_ID], r->user_id)))
        return rc;
    PyObject *model = field(r->leaf, M_MODEL);
    if (!model) return -1;
    int truth = PyObject_IsTrue(model);
    rc = truth < 0 ? -1 : truth ? col_str_obj(&c[R_MODEL], model) : col_str(&c[R_MODEL], "", 0, 1);
    Py_DECREF(model);
    if (rc) return rc;
    if ((rc = col_field_str(&c[R_TOKENIZER], head->tok, T_TOKENIZER)) ||
        (rc = col_field_str(&c[R_TEMPLATE], head->tok, T_TEMPLATE)) ||
        (rc = col_field_str(&c[R_ENGINE], head->tok, T_ENGINE)) ||
        (rc = col_str_obj(&c[R_SYSTEM], get(r->leaf_work, K_SYSTEM_PROMPT))) ||
        (rc = col_json(&c[R_TOOLS], o, get(r->leaf_work, K_TOOLS))))
        return rc;
    if (col_f64_obj(&c[R_REWARD], r->reward) < 0 || col_bool(&c[R_COMPLETE], r->complete) < 0) return -1;
    Col *paths = &c[R_POLICY_PATHS];
    if (str_begin(paths) < 0 || buf_policy_paths(&paths->values, o, r) < 0 || str_end(paths, 1) < 0) return -1;
    if (col_len(&c[R_TURNS], r->n_turns) < 0) return -1;
    for (Py_ssize_t i = 0; i < r->n_turns; i++)
        if ((rc = write_turn_cols(c, o, &p->turns[r->turns[i]]))) return rc;
    Py_ssize_t groups = 0, g = 0;
    while (g < r->n_turns) {
        Py_ssize_t e = g + 1;
        while (e < r->n_turns && p->turns[r->turns[e]].extends) e++;
        if (write_sample_cols(c, p, r, g, e) < 0) return -1;
        groups++;
        g = e;
    }
    return col_len(&c[R_SAMPLES], groups);
}

static PyObject *buf_bytes(Buf *b) { return PyBytes_FromStringAndSize(b->data ? b->data : "", b->len); }

int page_cols(Page *p, Col cols[N_COLS]) {
    int rc = 0;
    for (Py_ssize_t i = 0; i < p->n_rollouts && rc == 0; i++) rc = write_rollout_cols(cols, p, &p->rollouts[i]);
    return rc;
}

void cols_free(Col cols[N_COLS]) {
    for (int k = 0; k < N_COLS; k++) {
        PyMem_Free(cols[k].values.data);
        PyMem_Free(cols[k].offsets.data);
        PyMem_Free(cols[k].valid.data);
    }
}

/* the page's columns: {name: (values, offsets or None, validity or None)}; None: a value this code
 * does not take (the Python path) */
PyObject *page_arrow(Page *p) {
    Col cols[N_COLS];
    memset(cols, 0, sizeof(cols));
    PyObject *out = NULL;
    int rc = page_cols(p, cols);
    if (rc == -3) {
        Py_INCREF(Py_None);
        out = Py_None;
        goto done;
    }
    if (rc < 0 || !(out = PyDict_New())) goto done;
    for (int k = 0; k < N_COLS; k++) {
        Col *c = &cols[k];
        PyObject *values = buf_bytes(&c->values);
        PyObject *offsets = c->offsets.len ? buf_bytes(&c->offsets) : (Py_INCREF(Py_None), Py_None);
        PyObject *valid = c->nulls ? buf_bytes(&c->valid) : (Py_INCREF(Py_None), Py_None);
        PyObject *entry = values && offsets && valid ? PyTuple_Pack(3, values, offsets, valid) : NULL;
        Py_XDECREF(values);
        Py_XDECREF(offsets);
        Py_XDECREF(valid);
        if (!entry || PyDict_SetItemString(out, COL_NAMES[k], entry) < 0) {
            Py_XDECREF(entry);
            Py_CLEAR(out);
            goto done;
        }
        Py_DECREF(entry);
    }
done:
    cols_free(cols);
    return out;
}
