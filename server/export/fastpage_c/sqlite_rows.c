/* An export page's rows read from SQLite without the ``sqlite3`` module in between: the same library
 * (its functions found through the ``_sqlite3`` extension Python loaded, so nothing is linked at build
 * time), a connection of its own opened without SQLite's mutexes, prepared statements kept, and each
 * row made a tuple of the values ``sqlite3`` gives by default (int, float, str, bytes, None). The
 * ``sqlite3`` module releases and takes back the GIL around every step and SQLite locks its connection
 * mutex around every column read: on an export's rows, a tenth of a worker's time. A connection here
 * belongs to one thread (the GIL is held while it is used). Python: server/export/fastpage.py. */
#include "page.h"

#include <dlfcn.h>

typedef struct sqlite3 sqlite3;
typedef struct sqlite3_stmt sqlite3_stmt;
typedef long long sqlite3_int64;

#define SQLITE_OK 0
#define SQLITE_ROW 100
#define SQLITE_DONE 101
#define SQLITE_INTEGER 1
#define SQLITE_FLOAT 2
#define SQLITE_TEXT 3
#define SQLITE_BLOB 4
#define SQLITE_OPEN_READWRITE 0x00000002
#define SQLITE_OPEN_URI 0x00000040
#define SQLITE_OPEN_NOMUTEX 0x00008000
#define SQLITE_PREPARE_PERSISTENT 0x01
#define SQLITE_TRANSIENT ((void (*)(void *))-1)

static struct {
    int (*open_v2)(const char *, sqlite3 **, int, const char *);
    int (*close_v2)(sqlite3 *);
    const char *(*errmsg)(sqlite3 *);
    int (*exec)(sqlite3 *, const char *, void *, void *, char **);
    int (*prepare_v3)(sqlite3 *, const char *, int, unsigned int, sqlite3_stmt **, const char **);
    int (*finalize)(sqlite3_stmt *);
    int (*reset)(sqlite3_stmt *);
    int (*clear_bindings)(sqlite3_stmt *);
    int (*bind_text)(sqlite3_stmt *, int, const char *, int, void (*)(void *));
    int (*bind_int64)(sqlite3_stmt *, int, sqlite3_int64);
    int (*bind_double)(sqlite3_stmt *, int, double);
    int (*bind_null)(sqlite3_stmt *, int);
    int (*bind_parameter_count)(sqlite3_stmt *);
    int (*step)(sqlite3_stmt *);
    int (*column_count)(sqlite3_stmt *);
    int (*column_type)(sqlite3_stmt *, int);
    sqlite3_int64 (*column_int64)(sqlite3_stmt *, int);
    double (*column_double)(sqlite3_stmt *, int);
    const unsigned char *(*column_text)(sqlite3_stmt *, int);
    const void *(*column_blob)(sqlite3_stmt *, int);
    int (*column_bytes)(sqlite3_stmt *, int);
} api;
static int api_state;  /* 0 not looked up, 1 found, -1 not found */

/* the library's functions, from the extension module at ``path`` and what it links */
static int find_api(const char *path) {
    if (api_state) return api_state;
    api_state = -1;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (!lib) return api_state;
#define FIND(field, name)                                  \
    if (!(*(void **)&api.field = dlsym(lib, "sqlite3_" name))) \
        return api_state;
    FIND(open_v2, "open_v2")
    FIND(close_v2, "close_v2")
    FIND(errmsg, "errmsg")
    FIND(exec, "exec")
    FIND(prepare_v3, "prepare_v3")
    FIND(finalize, "finalize")
    FIND(reset, "reset")
    FIND(clear_bindings, "clear_bindings")
    FIND(bind_text, "bind_text")
    FIND(bind_int64, "bind_int64")
    FIND(bind_double, "bind_double")
    FIND(bind_null, "bind_null")
    FIND(bind_parameter_count, "bind_parameter_count")
    FIND(step, "step")
    FIND(column_count, "column_count")
    FIND(column_type, "column_type")
    FIND(column_int64, "column_int64")
    FIND(column_double, "column_double")
    FIND(column_text, "column_text")
    FIND(column_blob, "column_blob")
    FIND(column_bytes, "column_bytes")
#undef FIND
    api_state = 1;
    return api_state;
}

#define KEPT 8  /* statements kept per connection (an export runs 3) */

typedef struct {
    sqlite3 *db;
    PyObject *sql[KEPT];  /* owned str, or NULL */
    sqlite3_stmt *stmt[KEPT];
} Reader;

static const char CAPSULE[] = "tokentrail.sqlite_reader";

static void reader_close(Reader *r) {
    for (int i = 0; i < KEPT; i++) {
        if (r->stmt[i]) api.finalize(r->stmt[i]);
        r->stmt[i] = NULL;
        Py_CLEAR(r->sql[i]);
    }
    if (r->db) api.close_v2(r->db);
    r->db = NULL;
}

static void capsule_free(PyObject *capsule) {
    Reader *r = PyCapsule_GetPointer(capsule, CAPSULE);
    if (!r) {
        PyErr_Clear();
        return;
    }
    reader_close(r);
    PyMem_Free(r);
}

static PyObject *fail(Reader *r, const char *what) {
    PyErr_Format(PyExc_RuntimeError, "sqlite: %s: %s", what, r->db ? api.errmsg(r->db) : "no connection");
    return NULL;
}

/* sqlite_open(extension path, filename, uri, pragmas) -> a reader, or None where the library's functions
 * cannot be found (the caller reads through ``sqlite3``) */
PyObject *sqlite_open(PyObject *self, PyObject *args) {
    const char *lib, *filename;
    int uri;
    PyObject *pragmas;
    if (!PyArg_ParseTuple(args, "sspO", &lib, &filename, &uri, &pragmas)) return NULL;
    if (find_api(lib) < 0) Py_RETURN_NONE;
    Reader *r = PyMem_Calloc(1, sizeof(Reader));
    if (!r) return PyErr_NoMemory();
    int flags = SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX | (uri ? SQLITE_OPEN_URI : 0);
    if (api.open_v2(filename, &r->db, flags, NULL) != SQLITE_OK) {
        fail(r, "open");
        reader_close(r);
        PyMem_Free(r);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(pragmas, "pragmas: a sequence of str");
    for (Py_ssize_t i = 0; seq && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *text = PyUnicode_FromFormat("PRAGMA %U", PySequence_Fast_GET_ITEM(seq, i));
        const char *sql = text ? PyUnicode_AsUTF8(text) : NULL;
        int rc = sql ? api.exec(r->db, sql, NULL, NULL, NULL) : -1;
        Py_XDECREF(text);
        if (rc != SQLITE_OK) {
            if (!PyErr_Occurred()) fail(r, "pragma");
            Py_CLEAR(seq);
        }
    }
    if (!seq) {
        reader_close(r);
        PyMem_Free(r);
        return NULL;
    }
    Py_DECREF(seq);
    PyObject *capsule = PyCapsule_New(r, CAPSULE, capsule_free);
    if (!capsule) {
        reader_close(r);
        PyMem_Free(r);
    }
    return capsule;
}

/* sqlite_close(reader): its statements and connection closed (again: nothing) */
PyObject *sqlite_close(PyObject *self, PyObject *capsule) {
    Reader *r = PyCapsule_GetPointer(capsule, CAPSULE);
    if (!r) return NULL;
    reader_close(r);
    Py_RETURN_NONE;
}

static sqlite3_stmt *statement(Reader *r, PyObject *sql) {
    int free_slot = -1;
    for (int i = 0; i < KEPT; i++) {
        if (r->sql[i] == sql || (r->sql[i] && PyUnicode_Compare(r->sql[i], sql) == 0)) return r->stmt[i];
        if (!r->sql[i] && free_slot < 0) free_slot = i;
    }
    Py_ssize_t n;
    const char *text = PyUnicode_AsUTF8AndSize(sql, &n);
    if (!text) return NULL;
    sqlite3_stmt *stmt = NULL;
    if (api.prepare_v3(r->db, text, (int)n + 1, free_slot >= 0 ? SQLITE_PREPARE_PERSISTENT : 0, &stmt, NULL) !=
            SQLITE_OK ||
        !stmt) {
        fail(r, "prepare");
        return NULL;
    }
    if (free_slot < 0) {  /* (more statements than kept: the last one goes) */
        free_slot = KEPT - 1;
        api.finalize(r->stmt[free_slot]);
        Py_CLEAR(r->sql[free_slot]);
    }
    r->stmt[free_slot] = stmt;
    r->sql[free_slot] = Py_NewRef(sql);
    return stmt;
}

static int bind(Reader *r, sqlite3_stmt *stmt, int i, PyObject *v) {
    int rc;
    if (v == Py_None) {
        rc = api.bind_null(stmt, i);
    } else if (PyLong_CheckExact(v)) {
        long long x = PyLong_AsLongLong(v);
        if (x == -1 && PyErr_Occurred()) return -1;
        rc = api.bind_int64(stmt, i, x);
    } else if (PyFloat_CheckExact(v)) {
        rc = api.bind_double(stmt, i, PyFloat_AS_DOUBLE(v));
    } else if (PyUnicode_CheckExact(v)) {
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(v, &n);
        if (!s) return -1;
        rc = api.bind_text(stmt, i, s, (int)n, SQLITE_TRANSIENT);
    } else {
        PyErr_Format(PyExc_TypeError, "sqlite_rows: a parameter of type %s", Py_TYPE(v)->tp_name);
        return -1;
    }
    if (rc != SQLITE_OK) {
        fail(r, "bind");
        return -1;
    }
    return 0;
}

static PyObject *column(sqlite3_stmt *stmt, int i) {
    switch (api.column_type(stmt, i)) {
        case SQLITE_INTEGER: return PyLong_FromLongLong(api.column_int64(stmt, i));
        case SQLITE_FLOAT: return PyFloat_FromDouble(api.column_double(stmt, i));
        case SQLITE_TEXT: {
            const char *s = (const char *)api.column_text(stmt, i);
            return PyUnicode_DecodeUTF8(s ? s : "", api.column_bytes(stmt, i), NULL);
        }
        case SQLITE_BLOB: {
            const void *s = api.column_blob(stmt, i);
            return PyBytes_FromStringAndSize(s ? s : "", api.column_bytes(stmt, i));
        }
        default: Py_RETURN_NONE;
    }
}

/* sqlite_rows(reader, sql, params) -> the statement's rows, a tuple each (``cursor.execute(...).fetchall()``) */
PyObject *sqlite_rows(PyObject *self, PyObject *args) {
    PyObject *capsule, *sql, *params;
    if (!PyArg_ParseTuple(args, "OUO", &capsule, &sql, &params)) return NULL;
    Reader *r = PyCapsule_GetPointer(capsule, CAPSULE);
    if (!r) return NULL;
    if (!r->db) {
        PyErr_SetString(PyExc_RuntimeError, "sqlite_rows: the reader is closed");
        return NULL;
    }
    sqlite3_stmt *stmt = statement(r, sql);
    if (!stmt) return NULL;
    PyObject *seq = PySequence_Fast(params, "sqlite_rows: params, a sequence"), *rows = NULL;
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n != api.bind_parameter_count(stmt)) {
        PyErr_Format(PyExc_ValueError, "sqlite_rows: %zd parameters for %d", n, api.bind_parameter_count(stmt));
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (bind(r, stmt, (int)i + 1, PySequence_Fast_GET_ITEM(seq, i)) < 0) goto done;
    if (!(rows = PyList_New(0))) goto done;
    int width = api.column_count(stmt), rc;
    while ((rc = api.step(stmt)) == SQLITE_ROW) {
        PyObject *row = PyTuple_New(width);
        if (!row) goto fail;
        for (int i = 0; i < width; i++) {
            PyObject *v = column(stmt, i);
            if (!v) {
                Py_DECREF(row);
                goto fail;
            }
            PyTuple_SET_ITEM(row, i, v);
        }
        int err = PyList_Append(rows, row);
        Py_DECREF(row);
        if (err < 0) goto fail;
    }
    if (rc != SQLITE_DONE) {
        fail(r, "step");
        goto fail;
    }
    goto done;
fail:
    Py_CLEAR(rows);
done:
    api.reset(stmt);  /* (ends the statement's read: a kept statement must not hold the WAL) */
    api.clear_bindings(stmt);
    Py_DECREF(seq);
    return rows;
}
