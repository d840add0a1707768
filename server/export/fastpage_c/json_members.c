/* A few members of a JSON object found without decoding the rest: a message's work parameters hold
 * its sampling parameters, seed, system prompt and tools beside what an export does not read, and
 * decoding all of it for every turn was a tenth of the export's time. The text is checked as strict
 * JSON (RFC 8259) on the way; anything this reader does not take (not an object, a member name with an
 * escape, nesting deeper than 64, a run of 19 digits, NaN, invalid text) returns "not taken" and the
 * caller decodes the whole text as before, so the values and errors are the decoder's. */
#include "page.h"

#define MAX_DEPTH 64

static Py_ssize_t ws(const char *s, Py_ssize_t i, Py_ssize_t n) {
    while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) i++;
    return i;
}

static int hex(char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* a string starting at s[i] == '"': the index after it, or -1; *escaped when it holds an escape */
static Py_ssize_t string(const char *s, Py_ssize_t i, Py_ssize_t n, int *escaped) {
    for (i++; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"') return i + 1;
        if (c < 0x20) return -1;
        if (c == '\\') {
            *escaped = 1;
            if (++i >= n) return -1;
            if (s[i] == 'u') {
                if (i + 4 >= n || !hex(s[i + 1]) || !hex(s[i + 2]) || !hex(s[i + 3]) || !hex(s[i + 4])) return -1;
                i += 4;
            } else if (!strchr("\"\\/bfnrt", s[i]) || !s[i]) {
                return -1;
            }
        }
    }
    return -1;
}

static Py_ssize_t digits(const char *s, Py_ssize_t i, Py_ssize_t n) {
    Py_ssize_t start = i;
    while (i < n && s[i] >= '0' && s[i] <= '9') i++;
    return i > start && i - start < 19 ? i : -1;  /* (19 digits: maybe beyond 64 bits: the decoder's) */
}

static Py_ssize_t number(const char *s, Py_ssize_t i, Py_ssize_t n) {
    if (s[i] == '-') i++;
    if (i >= n) return -1;
    if (s[i] == '0') {
        i++;
    } else if ((i = digits(s, i, n)) < 0) {
        return -1;
    }
    if (i < n && s[i] == '.' && (i = digits(s, i + 1, n)) < 0) return -1;
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        i++;
        if (i < n && (s[i] == '+' || s[i] == '-')) i++;
        if ((i = digits(s, i, n)) < 0) return -1;
    }
    return i;
}

static Py_ssize_t literal(const char *s, Py_ssize_t i, Py_ssize_t n, const char *word, Py_ssize_t len) {
    return n - i >= len && memcmp(s + i, word, (size_t)len) == 0 ? i + len : -1;
}

static Py_ssize_t value(const char *s, Py_ssize_t i, Py_ssize_t n, int depth);

static Py_ssize_t container(const char *s, Py_ssize_t i, Py_ssize_t n, int depth, char close) {
    if (depth >= MAX_DEPTH) return -1;
    i = ws(s, i + 1, n);
    if (i < n && s[i] == close) return i + 1;
    for (;;) {
        if (close == '}') {
            int escaped = 0;
            if (i >= n || s[i] != '"' || (i = string(s, i, n, &escaped)) < 0) return -1;
            i = ws(s, i, n);
            if (i >= n || s[i] != ':') return -1;
            i = ws(s, i + 1, n);
        }
        if ((i = value(s, i, n, depth + 1)) < 0) return -1;
        i = ws(s, i, n);
        if (i >= n) return -1;
        if (s[i] == close) return i + 1;
        if (s[i] != ',') return -1;
        i = ws(s, i + 1, n);
    }
}

static Py_ssize_t value(const char *s, Py_ssize_t i, Py_ssize_t n, int depth) {
    if (i >= n) return -1;
    int escaped = 0;
    switch (s[i]) {
        case '"': return string(s, i, n, &escaped);
        case '{': return container(s, i, n, depth, '}');
        case '[': return container(s, i, n, depth, ']');
        case 't': return literal(s, i, n, "true", 4);
        case 'f': return literal(s, i, n, "false", 5);
        case 'n': return literal(s, i, n, "null", 4);
        default: return (s[i] == '-' || (s[i] >= '0' && s[i] <= '9')) ? number(s, i, n) : -1;
    }
}

int json_members(const char *s, Py_ssize_t n, const char *const *names, int k, Py_ssize_t *start, Py_ssize_t *end) {
    for (int j = 0; j < k; j++) start[j] = end[j] = -1;
    Py_ssize_t i = ws(s, 0, n);
    if (i >= n || s[i] != '{') return 0;
    i = ws(s, i + 1, n);
    if (i < n && s[i] == '}') return ws(s, i + 1, n) == n;
    for (;;) {
        int escaped = 0;
        if (i >= n || s[i] != '"') return 0;
        Py_ssize_t name = i + 1;
        if ((i = string(s, i, n, &escaped)) < 0 || escaped) return 0;
        Py_ssize_t name_len = i - 1 - name;
        i = ws(s, i, n);
        if (i >= n || s[i] != ':') return 0;
        i = ws(s, i + 1, n);
        Py_ssize_t at = i;
        if ((i = value(s, i, n, 1)) < 0) return 0;
        for (int j = 0; j < k; j++) {  /* (a repeated name: its last value, as decoders keep) */
            if ((Py_ssize_t)strlen(names[j]) == name_len && memcmp(s + name, names[j], (size_t)name_len) == 0) {
                start[j] = at;
                end[j] = i;
            }
        }
        i = ws(s, i, n);
        if (i >= n) return 0;
        if (s[i] == '}') return ws(s, i + 1, n) == n;
        if (s[i] != ',') return 0;
        i = ws(s, i + 1, n);
    }
}
