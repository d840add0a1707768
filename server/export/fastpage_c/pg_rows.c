/* An export page's rows read from PostgreSQL off the socket of an asyncpg connection, in C: asyncpg
 * opens and authenticates the connection, then stops reading it; this code sends the extended query
 * protocol's messages (built in Python: server/export/pg_wire.py), reads the answers with blocking
 * calls (the GIL released while it waits) and makes each DataRow a tuple of the values asyncpg gives for
 * its columns' types (str, bytes, int, float, bool, datetime, None). asyncpg makes a Record through a
 * codec call per field: on an export's rows, a third of a worker's time.
 *
 * A reader keeps what it has received past the end of an answer (an asynchronous notice) for the next
 * one. Text columns keep the last value they decoded and give it again where the next row holds the
 * same bytes: roles, states, model names and hashes repeat row after row. */
#include "page.h"

#include <datetime.h>
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <sys/socket.h>

static const char CAPSULE[] = "tokentrail.pg_reader";

typedef struct {
    int fd;
    int broken;  /* an exchange ended before its ReadyForQuery: the stream is out of step */
    char *buf;
    Py_ssize_t start, end, cap;  /* unread bytes: buf[start:end] */
} Reader;

static void capsule_free(PyObject *capsule) {
    Reader *r = PyCapsule_GetPointer(capsule, CAPSULE);
    if (!r) {
        PyErr_Clear();
        return;
    }
    PyMem_Free(r->buf);
    PyMem_Free(r);
}

/* pg_open(socket fd) -> a reader of that socket (the caller keeps the socket open while it is used) */
PyObject *pg_open(PyObject *self, PyObject *arg) {
    int fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred()) return NULL;
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "pg_open: a file descriptor");
        return NULL;
    }
    Reader *r = PyMem_Calloc(1, sizeof(Reader));
    if (!r) return PyErr_NoMemory();
    r->fd = fd;
    r->cap = 1 << 18;
    if (!(r->buf = PyMem_Malloc(r->cap))) {
        PyMem_Free(r);
        return PyErr_NoMemory();
    }
    PyObject *capsule = PyCapsule_New(r, CAPSULE, capsule_free);
    if (!capsule) {
        PyMem_Free(r->buf);
        PyMem_Free(r);
    }
    return capsule;
}

/* wait until fd is ready for ``events`` (the GIL released): 0, or -1 with OSError set */
static int wait_fd(int fd, short events) {
    struct pollfd p = {fd, events, 0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    do rc = poll(&p, 1, -1);
    while (rc < 0 && errno == EINTR);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

/* after a send or recv that failed with errno: 0 to try again (interrupted, or the socket ready for
 * ``events`` now), -1 with an exception set */
static int again(Reader *r, short events) {
    if (errno == EINTR) return 0;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return wait_fd(r->fd, events);
    PyErr_SetFromErrno(PyExc_ConnectionError);
    return -1;
}

static int send_all(Reader *r, const char *data, Py_ssize_t n) {
    while (n > 0) {
        ssize_t k = send(r->fd, data, (size_t)n, MSG_NOSIGNAL);
        if (k < 0) {
            if (again(r, POLLOUT) < 0) return -1;
            continue;
        }
        data += k;
        n -= k;
    }
    return 0;
}

/* at least ``need`` unread bytes in the buffer: 0, or -1 with an exception set */
static int fill(Reader *r, Py_ssize_t need) {
    if (r->end - r->start >= need) return 0;
    if (r->start) {  /* the unread bytes to the front */
        memmove(r->buf, r->buf + r->start, (size_t)(r->end - r->start));
        r->end -= r->start;
        r->start = 0;
    }
    if (need > r->cap) {
        Py_ssize_t cap = r->cap;
        while (cap < need) cap *= 2;
        char *buf = PyMem_Realloc(r->buf, cap);
        if (!buf) {
            PyErr_NoMemory();
            return -1;
        }
        r->buf = buf;
        r->cap = cap;
    }
    while (r->end < need) {
        ssize_t k = recv(r->fd, r->buf + r->end, (size_t)(r->cap - r->end), 0);
        if (k > 0) {
            r->end += k;
            continue;
        }
        if (k == 0) {
            PyErr_SetString(PyExc_ConnectionResetError, "PostgreSQL closed the connection");
            return -1;
        }
        if (again(r, POLLIN) < 0) return -1;
    }
    return 0;
}

static inline uint32_t be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static inline uint64_t be64(const unsigned char *p) { return (uint64_t)be32(p) << 32 | be32(p + 4); }

static inline double be_f32(const unsigned char *p) {
    uint32_t u = be32(p);
    float x;
    memcpy(&x, &u, 4);
    return x;
}

static inline double be_f64(const unsigned char *p) {
    uint64_t u = be64(p);
    double x;
    memcpy(&x, &u, 8);
    return x;
}

/* --- values ---------------------------------------------------------------------------------------- */

/* the decoders' codes (pg_wire.py's _CODES) */
enum {
    C_TEXT = 's', C_BYTES = 'b', C_INT2 = 'h', C_INT4 = 'i', C_INT8 = 'q', C_FLOAT4 = 'f', C_FLOAT8 = 'd',
    C_BOOL = '?', C_TIMESTAMP = 't', C_TIMESTAMPTZ = 'T'
};

#define USECS_PER_DAY 86400000000LL
#define INFINITY_TS INT64_MAX
#define NEG_INFINITY_TS INT64_MIN

/* microseconds since 2000-01-01 as a datetime (tz: None or UTC), as asyncpg's codec gives it: infinity
 * and -infinity as the largest and the smallest datetime, without a time zone whatever the type */
static PyObject *timestamp(int64_t us, PyObject *tz) {
    int y, mo, d, h, mi, s, f;
    if (us == INFINITY_TS) {
        y = 9999, mo = 12, d = 31, h = 23, mi = 59, s = 59, f = 999999, tz = Py_None;
    } else if (us == NEG_INFINITY_TS) {
        y = 1, mo = 1, d = 1, h = 0, mi = 0, s = 0, f = 0, tz = Py_None;
    } else {
        int64_t days = us / USECS_PER_DAY, rest = us % USECS_PER_DAY;
        if (rest < 0) {
            rest += USECS_PER_DAY;
            days -= 1;
        }
        /* civil date from days since 1970-01-01 (H. Hinnant's algorithm); 2000-01-01 is day 10957 */
        int64_t z = days + 10957 + 719468;
        int64_t era = (z >= 0 ? z : z - 146096) / 146097;
        int64_t doe = z - era * 146097;
        int64_t yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
        int64_t doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        int64_t mp = (5 * doy + 2) / 153;
        int64_t year = yoe + era * 400;
        d = (int)(doy - (153 * mp + 2) / 5 + 1);
        mo = (int)(mp < 10 ? mp + 3 : mp - 9);
        year += mo <= 2;
        if (year < 1 || year > 9999) {
            PyErr_Format(PyExc_ValueError, "a PostgreSQL timestamp outside Python's years 1-9999 (%lld)",
                         (long long)year);
            return NULL;
        }
        y = (int)year;
        h = (int)(rest / 3600000000LL);
        mi = (int)(rest / 60000000LL % 60);
        s = (int)(rest / 1000000 % 60);
        f = (int)(rest % 1000000);
    }
    return PyDateTimeAPI->DateTime_FromDateAndTime(y, mo, d, h, mi, s, f, tz, PyDateTimeAPI->DateTimeType);
}

static PyObject *bad_length(char code, uint32_t n) {
    PyErr_Format(PyExc_ValueError, "pg_rows: a value of %u bytes for type code '%c'", n, code);
    return NULL;
}

static PyObject *value(char code, const unsigned char *p, uint32_t n, PyObject **last) {
    switch (code) {
        case C_TEXT: {
            if (*last) {
                Py_ssize_t k;
                const char *s = PyUnicode_AsUTF8AndSize(*last, &k);
                if (!s) return NULL;
                if ((uint32_t)k == n && memcmp(s, p, n) == 0) return Py_NewRef(*last);
            }
            PyObject *v = PyUnicode_DecodeUTF8((const char *)p, n, NULL);
            if (v) Py_XSETREF(*last, Py_NewRef(v));
            return v;
        }
        case C_BYTES: return PyBytes_FromStringAndSize((const char *)p, n);
        case C_BOOL:
            if (n != 1) return bad_length(code, n);
            return PyBool_FromLong(p[0]);
        case C_INT2:
            if (n != 2) return bad_length(code, n);
            return PyLong_FromLong((int16_t)((uint16_t)p[0] << 8 | p[1]));
        case C_INT4:
            if (n != 4) return bad_length(code, n);
            return PyLong_FromLong((int32_t)be32(p));
        case C_INT8:
            if (n != 8) return bad_length(code, n);
            return PyLong_FromLongLong((int64_t)be64(p));
        case C_FLOAT4:
            if (n != 4) return bad_length(code, n);
            return PyFloat_FromDouble(be_f32(p));
        case C_FLOAT8:
            if (n != 8) return bad_length(code, n);
            return PyFloat_FromDouble(be_f64(p));
        case C_TIMESTAMP:
        case C_TIMESTAMPTZ:
            if (n != 8) return bad_length(code, n);
            return timestamp((int64_t)be64(p), code == C_TIMESTAMPTZ ? PyDateTime_TimeZone_UTC : Py_None);
        default: PyErr_Format(PyExc_ValueError, "pg_rows: unknown type code '%c'", code); return NULL;
    }
}

static PyObject *data_row(const unsigned char *p, Py_ssize_t len, const char *codes, Py_ssize_t width,
                          PyObject **last) {
    if (len < 2 || (Py_ssize_t)((uint16_t)p[0] << 8 | p[1]) != width) {
        PyErr_Format(PyExc_ValueError, "pg_rows: a row of other than %zd columns", width);
        return NULL;
    }
    const unsigned char *end = p + len;
    p += 2;
    PyObject *row = PyTuple_New(width);
    if (!row) return NULL;
    for (Py_ssize_t i = 0; i < width; i++) {
        if (end - p < 4) goto short_row;
        uint32_t n = be32(p);
        p += 4;
        PyObject *v;
        if (n == 0xFFFFFFFFu) {
            v = Py_NewRef(Py_None);
        } else {
            if ((uint32_t)(end - p) < n) goto short_row;
            v = value(codes[i], p, n, &last[i]);
            p += n;
        }
        if (!v) {
            Py_DECREF(row);
            return NULL;
        }
        PyTuple_SET_ITEM(row, i, v);
    }
    return row;
short_row:
    Py_DECREF(row);
    PyErr_SetString(PyExc_ValueError, "pg_rows: a DataRow shorter than its fields");
    return NULL;
}

/* --- an exchange ----------------------------------------------------------------------------------- */

/* the fields of an ErrorResponse: {code letter: text} */
static PyObject *error_fields(const unsigned char *p, Py_ssize_t len) {
    PyObject *fields = PyDict_New();
    const unsigned char *end = p + len;
    while (fields && p < end && *p) {
        char key[2] = {(char)*p++, 0};
        const unsigned char *z = memchr(p, 0, (size_t)(end - p));
        if (!z) break;
        PyObject *v = PyUnicode_DecodeUTF8((const char *)p, z - p, "replace");
        if (!v || PyDict_SetItemString(fields, key, v) < 0) Py_CLEAR(fields);
        Py_XDECREF(v);
        p = z + 1;
    }
    return fields;
}

/* pg_rows(reader, payload, codes) -> (rows, messages, error): sends ``payload`` (frontend messages ending
 * with Sync) and reads the answers up to ReadyForQuery. DataRows become tuples decoded by ``codes`` (a
 * type code per column, bytes; None where no rows are expected); ``messages``: the (type, body) of the
 * other messages but notices, parameter statuses and notifications; ``error``: the first ErrorResponse's
 * fields, or None. */
PyObject *pg_rows(PyObject *self, PyObject *args) {
    PyObject *capsule, *codes_obj;
    Py_buffer payload;
    if (!PyArg_ParseTuple(args, "Oy*O", &capsule, &payload, &codes_obj)) return NULL;
    Reader *r = PyCapsule_GetPointer(capsule, CAPSULE);
    const char *codes = NULL;
    Py_ssize_t width = 0;
    PyObject *rows = NULL, *messages = NULL, *error = NULL, *result = NULL, **last = NULL;
    if (!r) goto done;
    if (r->broken) {
        PyErr_SetString(PyExc_ConnectionError, "pg_rows: an earlier exchange on this connection failed");
        goto done;
    }
    if (codes_obj != Py_None) {
        if (!PyBytes_Check(codes_obj)) {
            PyErr_SetString(PyExc_TypeError, "pg_rows: codes, bytes or None");
            goto done;
        }
        codes = PyBytes_AS_STRING(codes_obj);
        width = PyBytes_GET_SIZE(codes_obj);
        if (width && !(last = PyMem_Calloc(width, sizeof(PyObject *)))) {
            PyErr_NoMemory();
            goto done;
        }
    }
    if (!(rows = PyList_New(0)) || !(messages = PyList_New(0))) goto done;
    r->broken = 1;  /* until its ReadyForQuery */
    if (send_all(r, payload.buf, payload.len) < 0) goto done;
    for (;;) {
        if (fill(r, 5) < 0) goto done;
        const unsigned char *h = (const unsigned char *)r->buf + r->start;
        char type = (char)h[0];
        uint32_t n = be32(h + 1);
        if (n < 4 || n > (1u << 30)) {
            PyErr_Format(PyExc_ValueError, "pg_rows: a message of %u bytes", n);
            goto done;
        }
        if (fill(r, 1 + (Py_ssize_t)n) < 0) goto done;
        const unsigned char *body = (const unsigned char *)r->buf + r->start + 5;
        Py_ssize_t len = (Py_ssize_t)n - 4;
        r->start += 1 + (Py_ssize_t)n;
        if (type == 'D') {
            if (!codes) {
                PyErr_SetString(PyExc_ValueError, "pg_rows: a DataRow where none was expected");
                goto done;
            }
            PyObject *row = data_row(body, len, codes, width, last);
            int rc = row ? PyList_Append(rows, row) : -1;
            Py_XDECREF(row);
            if (rc < 0) goto done;
        } else if (type == 'Z') {
            break;
        } else if (type == 'E') {
            if (!error && !(error = error_fields(body, len))) goto done;
        } else if (type != 'N' && type != 'S' && type != 'A') {
            PyObject *m = Py_BuildValue("(Cy#)", type, body, len);
            int rc = m ? PyList_Append(messages, m) : -1;
            Py_XDECREF(m);
            if (rc < 0) goto done;
        }
    }
    r->broken = 0;
    if (r->start == r->end) r->start = r->end = 0;
    result = Py_BuildValue("(OOO)", rows, messages, error ? error : Py_None);
done:
    if (last)
        for (Py_ssize_t i = 0; i < width; i++) Py_XDECREF(last[i]);
    PyMem_Free(last);
    Py_XDECREF(rows);
    Py_XDECREF(messages);
    Py_XDECREF(error);
    PyBuffer_Release(&payload);
    return result;
}

int pg_init(void) {
    PyDateTime_IMPORT;
    return PyDateTimeAPI ? 0 : -1;
}
