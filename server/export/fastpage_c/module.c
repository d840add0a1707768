/* server.export._fastpage: a page of native rollouts as JSON lines, built and written in C: the bytes of
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
#include "page.h"

#ifdef __GLIBC__
#include <malloc.h>
#endif

PyObject *K_SAMPLING, *K_SEED, *K_TEMPERATURE, *K_SYSTEM_PROMPT, *K_TOOLS, *SUM;

/* the page of the arguments' chats, built into ``p``: 0, 1 a page this code does not take (the Python
 * builder), -1 error. The caller frees ``p`` and ``o``'s dicts (page_done) */
static int build(PyObject *args, Opts *o, Page *p) {
    PyObject *chats, *min_score;
    const char *rule;
    if (!PyArg_ParseTuple(args, "OppsOOOOOOOOOOOSO!", &chats, &o->rated_only, &o->include_incomplete, &rule,
                          &min_score, &o->leaf_passes, &o->recent_enough, &o->path, &o->json, &o->loads,
                          &o->created, &o->stop_reason, &o->dumps, &o->floats, &o->head, &o->rule_text,
                          &PyDict_Type, &o->stop_cache))
        return -1;
    if (!strcmp(rule, "last")) o->rule = RULE_LAST;
    else if (!strcmp(rule, "mean")) o->rule = RULE_MEAN;
    else if (!strcmp(rule, "min")) o->rule = RULE_MIN;
    else if (!strcmp(rule, "leaf")) o->rule = RULE_LEAF;
    else {
        PyErr_Format(PyExc_ValueError, "unknown reward rule %s", rule);
        return -1;
    }
    if (min_score != Py_None) {
        o->has_min_score = 1;
        o->min_score = PyFloat_AsDouble(min_score);
        if (o->min_score == -1.0 && PyErr_Occurred()) return -1;
    }
    p->o = o;
    if (!(p->index = PyDict_New()) || !(o->decoded = PyDict_New()) ||
        !(o->sampling_parts = PyDict_New()))
        return -1;
    PyObject *seq = PySequence_Fast(chats, "chats");
    if (!seq) return -1;
    int rc = 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) rc = add_chat(p, PySequence_Fast_GET_ITEM(seq, i));
    Py_DECREF(seq);  /* (the rows stay alive: the caller holds the chats) */
    return rc == -1 ? -1 : rc ? 1 : 0;
}

static void page_done(Opts *o, Page *p) {
    page_free(p);
    Py_XDECREF(o->decoded);
    Py_XDECREF(o->sampling_parts);
}

/* build, then write with ``writer`` (given ``extra``): (its result, rollouts), or None for the Python path */
static PyObject *run(PyObject *args, PyObject *(*writer)(Page *, PyObject *), PyObject *extra) {
    Opts o = {0};
    Page p = {0};
    PyObject *result = NULL;
    int rc = build(args, &o, &p);
    if (rc == 1) {
        Py_INCREF(Py_None);
        result = Py_None;
    } else if (rc == 0) {
        PyObject *written = writer(&p, extra);
        if (written == Py_None) result = written;
        else if (written) result = Py_BuildValue("(Nn)", written, p.n_rollouts);
    }
    page_done(&o, &p);
    return result;
}

static PyObject *jsonl_writer(Page *p, PyObject *extra) { return page_jsonl(p); }
static PyObject *arrow_writer(Page *p, PyObject *extra) { return page_arrow(p); }

static PyObject *encode_page(PyObject *self, PyObject *args) { return run(args, jsonl_writer, NULL); }

static PyObject *arrow_page(PyObject *self, PyObject *args) { return run(args, arrow_writer, NULL); }

static PyObject *parquet_page(PyObject *self, PyObject *args) {
    PyObject *build_args, *extra;
    if (!PyArg_ParseTuple(args, "O!O!", &PyTuple_Type, &build_args, &PyTuple_Type, &extra)) return NULL;
    return run(build_args, page_parquet, extra);
}

static PyObject *keep_freed_memory(PyObject *self, PyObject *arg) {
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n <= 0 || n > (1LL << 30)) {
        PyErr_SetString(PyExc_ValueError, "keep_freed_memory: a limit of 1 byte to 1 GiB");
        return NULL;
    }
#ifdef __GLIBC__
    return PyBool_FromLong(mallopt(M_MMAP_THRESHOLD, (int)n) && mallopt(M_TRIM_THRESHOLD, (int)(2 * n)));
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"encode_page", encode_page, METH_VARARGS,
     "encode_page(chats, rated_only, include_incomplete, reward_rule, min_score, leaf_passes, recent_enough, "
     "path, json, loads, created, stop_reason, dumps, floats, head, rule_text, stop_cache) -> (bytes, rollouts) | None"},
    {"arrow_page", arrow_page, METH_VARARGS,
     "arrow_page(the arguments of encode_page) -> ({column: (values, offsets, validity)}, rollouts) | None"},
    {"parquet_page", parquet_page, METH_VARARGS,
     "parquet_page((the arguments of encode_page), (schema, schema version, reward rule, zstd level, page bytes)) -> "
     "((column chunks, row group parts, row group offsets, rows), rollouts) | None"},
    {"parquet_leaves", parquet_leaves, METH_NOARGS,
     "parquet_leaves() -> [(path, physical type, max definition level, max repetition level)]"},
    {"keep_freed_memory", keep_freed_memory, METH_O,
     "keep_freed_memory(bytes) -> bool: smaller blocks from the heap, up to twice that kept when freed (glibc)"},
    {"sqlite_open", sqlite_open, METH_VARARGS,
     "sqlite_open(sqlite3 extension's path, filename, uri, pragmas) -> reader | None (the library not found)"},
    {"sqlite_rows", sqlite_rows, METH_VARARGS, "sqlite_rows(reader, sql, params) -> [tuple, ...]"},
    {"sqlite_close", sqlite_close, METH_O, "sqlite_close(reader)"},
    {"pg_open", pg_open, METH_O, "pg_open(socket fd) -> reader"},
    {"pg_rows", pg_rows, METH_VARARGS,
     "pg_rows(reader, payload, codes) -> (rows, [(message type, body)], error fields | None)"},
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
    if (!K_SAMPLING || !K_SEED || !K_TEMPERATURE || !K_SYSTEM_PROMPT || !K_TOOLS || !SUM || created_init() < 0 ||
        pg_init() < 0)
        return NULL;
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
