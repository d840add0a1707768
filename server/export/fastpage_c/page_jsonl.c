/* A built page as JSON lines: the bytes ``page_lines`` (server/export/page_jsonl.py) writes. */
#include "page.h"

/* a little-endian int32 */
static long long le32(const char *p) {
    const unsigned char *u = (const unsigned char *)p;
    return (int32_t)((uint32_t)u[0] | (uint32_t)u[1] << 8 | (uint32_t)u[2] << 16 | (uint32_t)u[3] << 24);
}

/* any value: JSON text (strings and integers here, the rest by orjson) */
int buf_value(Buf *b, Opts *o, PyObject *v) {
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

/* the rollout's policy_paths object: {"version": checkpoint directory or null, ...} */
int buf_policy_paths(Buf *b, Opts *o, Rollout *r) {
    if (buf_char(b, '{') < 0) return -1;
    for (Py_ssize_t j = 0; j < r->n_paths; j++) {
        if ((j && buf_char(b, ',') < 0) || buf_char(b, '"') < 0 || buf_ll(b, r->paths[j].v) < 0 ||
            PUT_LIT(b, "\":") < 0 || buf_value(b, o, r->paths[j].path) < 0)
            return -1;
    }
    return buf_char(b, '}');
}

int buf_stop(Buf *b, Opts *o, PyObject *raw) {
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
    char iso[CREATED_MAX];
    int plain = plain_created(o, raw, iso);
    if (plain) return plain < 0 ? -1 : buf_json_utf8(b, iso, plain);
    PyObject *text = created_text(o, raw);
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
    if (t->n_spans == 1 && !t->spans[0].start)  /* one version for the whole completion: the usual case */
        return buf_repeat(b, item, fmt_ll(item, (int32_t)t->spans[0].version), n, first);
    int32_t *out = PyMem_Malloc(sizeof(int32_t) * (size_t)n);
    if (!out) {
        PyErr_NoMemory();
        return -1;
    }
    turn_versions(t, out);
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
    if (PUT_LIT(b, ",\"policy_paths\":") < 0 || buf_policy_paths(b, o, r) < 0) return -1;
    return PUT_LIT(b, "}\n");
}


static Buf KEPT_TURNS, KEPT_OUT;

static void keep(Buf *kept, Buf *b) {
    if (!kept->data && b->cap <= (64 << 20)) *kept = *b;
    else PyMem_Free(b->data);
}

/* the page's rollouts as JSON lines (new bytes), each turn's record written once */
PyObject *page_jsonl(Page *p) {
    Floats f = {0};
    /* the buffers of the last call, taken (and given back at the end): fresh memory for each page
     * costs more in page faults than filling it */
    Buf turns_buf = KEPT_TURNS, out = KEPT_OUT;
    KEPT_TURNS = KEPT_OUT = (Buf){0};
    turns_buf.len = out.len = 0;
    PyObject *text = NULL;
    if (page_floats(p, &f) < 0) goto done;
    /* room for the records and lines, roughly, so that the buffers are not copied as they grow */
    Py_ssize_t items = 0;
    for (Py_ssize_t k = 0; k < p->n_turns; k++) items += p->turns[k].n_prompt + 2 * p->turns[k].n_completion;
    if (buf_reserve(&turns_buf, PyBytes_GET_SIZE(f.text) + items * 7 + p->n_turns * 1024) < 0 ||
        buf_reserve(&out, 2 * turns_buf.cap + p->n_rollouts * 1024) < 0)
        goto done;
    for (Py_ssize_t k = 0; k < p->n_turns; k++)
        if (write_turn(&turns_buf, p->o, &f, &p->turns[k]) < 0) goto done;
    for (Py_ssize_t i = 0; i < p->n_rollouts; i++)
        if (write_rollout(&out, p, &f, &turns_buf, &p->rollouts[i]) < 0) goto done;
    text = PyBytes_FromStringAndSize(out.data ? out.data : "", out.len);
done:
    Py_XDECREF(f.text);
    PyMem_Free(f.at);
    keep(&KEPT_TURNS, &turns_buf);
    keep(&KEPT_OUT, &out);
    return text;
}
