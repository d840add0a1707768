/* A growable byte buffer and the JSON text of integers and strings, as orjson writes them (the export's
 * page encoder, server/export/fastpage/). */
#ifndef TOKENTRAIL_JSON_BUF_H
#define TOKENTRAIL_JSON_BUF_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    char *data;
    Py_ssize_t len, cap;
} Buf;

static inline int buf_reserve(Buf *b, Py_ssize_t extra) {
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

static inline int buf_put(Buf *b, const char *s, Py_ssize_t n) {
    if (buf_reserve(b, n) < 0) return -1;
    memcpy(b->data + b->len, s, (size_t)n);
    b->len += n;
    return 0;
}

#define PUT_LIT(b, lit) buf_put((b), (lit), (Py_ssize_t)(sizeof(lit) - 1))

static inline int buf_char(Buf *b, char c) {
    if (buf_reserve(b, 1) < 0) return -1;
    b->data[b->len++] = c;
    return 0;
}

static const char DIGIT_PAIRS[] =
    "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";

/* decimal text of v into out (at least 21 bytes); returns its length */
static inline int fmt_ll(char *out, long long v) {
    char tmp[24];
    char *p = tmp + sizeof(tmp);
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    while (u >= 100) {  /* two digits at a time, from the right */
        unsigned d = (unsigned)(u % 100) * 2;
        u /= 100;
        *--p = DIGIT_PAIRS[d + 1];
        *--p = DIGIT_PAIRS[d];
    }
    if (u >= 10) {
        *--p = DIGIT_PAIRS[u * 2 + 1];
        *--p = DIGIT_PAIRS[u * 2];
    } else {
        *--p = (char)('0' + u);
    }
    int len = 0;
    if (v < 0) out[len++] = '-';
    int n = (int)(tmp + sizeof(tmp) - p);
    memcpy(out + len, p, (size_t)n);
    return len + n;
}

static inline int buf_ll(Buf *b, long long v) {
    if (buf_reserve(b, 24) < 0) return -1;
    b->len += fmt_ll(b->data + b->len, v);
    return 0;
}

/* n copies of item (with commas between) after ``*first`` items written (a comma before unless none) */
static inline int buf_repeat(Buf *b, const char *item, Py_ssize_t item_len, Py_ssize_t n, int *first) {
    if (n <= 0) return 0;
    if (buf_reserve(b, n * (item_len + 1)) < 0) return -1;
    char *p = b->data + b->len;
    if (!*first) *p++ = ',';
    *first = 0;
    /* the first item, then ",item" copied from what is written, doubling */
    memcpy(p, item, (size_t)item_len);
    Py_ssize_t unit = item_len + 1, total = (n - 1) * unit;
    char *run = p + item_len;
    if (total) {
        run[0] = ',';
        memcpy(run + 1, item, (size_t)item_len);
        Py_ssize_t done = unit;
        while (done < total) {
            Py_ssize_t k = done < total - done ? done : total - done;
            memcpy(run + done, run, (size_t)k);
            done += k;
        }
    }
    b->len = (run + total) - b->data;
    return 0;
}

/* JSON string escapes as orjson writes them: \" \\ \b \t \n \f \r, other controls as \u00xx */
static const char HEX[] = "0123456789abcdef";

static inline int buf_json_utf8(Buf *b, const char *u, Py_ssize_t n) {
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

static inline int buf_json_str(Buf *b, PyObject *s) {
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(s, &n);
    return u ? buf_json_utf8(b, u, n) : -1;
}

#endif
