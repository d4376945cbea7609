/*
 * spanrl.otlp_receiver._span_scan: one C pass over an OTLP Span's wire bytes at ingest.
 *
 * Called by otlp_decode.py for every span of an Export request. scan_span(raw) walks the
 * serialized opentelemetry.proto.trace.v1.Span once and either
 *   - returns (trace_id, span_id, name, start_time_unix_nano, rollout_id, task_id, attempt,
 *     present) when the span is well formed and passes every spanrl type rule, or
 *   - returns None: "not sure", and the exact Python validator in otlp_decode.py decides
 *     (and words the rejection).
 * It is deliberately conservative: anything unusual (an AnyValue with two fields set, unknown
 * fields inside attribute values, a wire type that does not match the schema, non-ASCII
 * characters in a spanrl key, a 10-byte token id, nesting deeper than MAX_DEPTH) returns None.
 * So it can never accept a span that the Python path would reject; tests check this on
 * generated and mutated spans.
 *
 * Why C: the Python path checks a token-id array with a regular expression at ~28 ns per id
 * and touches every attribute through protobuf wrappers; the whole raw protobuf parse of a
 * span costs less than either. Field numbers are those of the OTLP trace.proto and
 * common.proto (opentelemetry-proto).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_DEPTH 32

enum { WIRE_VARINT = 0, WIRE_I64 = 1, WIRE_LEN = 2, WIRE_I32 = 5 };

/* Bits of the "present" result: which identity keys the span carried itself. */
enum { HAS_ROLLOUT_ID = 1, HAS_TASK_ID = 2, HAS_ATTEMPT = 4, HAS_AGENT_NAME = 8 };

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} Cursor;

typedef struct {
    uint32_t number;
    int wire;
    uint64_t varint;
    int varint_bytes;
    const uint8_t *data;
    size_t len;
} Field;

typedef struct {
    const uint8_t *trace_id, *span_id, *parent_id, *name, *rollout_id, *task_id;
    size_t trace_id_len, span_id_len, parent_id_len, name_len, rollout_id_len, task_id_len;
    uint64_t start_ns;
    int64_t attempt;
    int present;
} SpanScan;

/* Each reader returns 1 on success and 0 for "leave it to the exact path". */

static int read_varint(Cursor *c, uint64_t *out, int *nbytes) {
    uint64_t value = 0;
    for (int i = 0; i < 10; i++) {
        if (c->p >= c->end) return 0;
        uint8_t byte = *c->p++;
        if (i == 9 && byte > 1) return 0; /* would overflow 64 bits */
        value |= (uint64_t)(byte & 0x7f) << (7 * i);
        if (!(byte & 0x80)) {
            *out = value;
            if (nbytes) *nbytes = i + 1;
            return 1;
        }
    }
    return 0;
}

static int next_field(Cursor *c, Field *f) {
    uint64_t tag;
    if (!read_varint(c, &tag, NULL) || tag > 0xFFFFFFFFu) return 0;
    f->number = (uint32_t)(tag >> 3);
    f->wire = (int)(tag & 7);
    if (f->number == 0) return 0;
    switch (f->wire) {
    case WIRE_VARINT:
        return read_varint(c, &f->varint, &f->varint_bytes);
    case WIRE_I64:
    case WIRE_I32: {
        size_t size = f->wire == WIRE_I64 ? 8 : 4;
        if ((size_t)(c->end - c->p) < size) return 0;
        f->data = c->p;
        f->len = size;
        c->p += size;
        return 1;
    }
    case WIRE_LEN: {
        uint64_t size;
        if (!read_varint(c, &size, NULL) || size > (uint64_t)(c->end - c->p)) return 0;
        f->data = c->p;
        f->len = (size_t)size;
        c->p += size;
        return 1;
    }
    default: /* groups and reserved wire types */
        return 0;
    }
}

static int valid_utf8(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        /* ASCII runs eight bytes at a time */
        while (i + 8 <= n) {
            uint64_t chunk;
            memcpy(&chunk, s + i, 8);
            if (chunk & 0x8080808080808080ULL) break;
            i += 8;
        }
        if (i >= n) break;
        uint8_t lead = s[i];
        if (lead < 0x80) {
            i++;
            continue;
        }
        size_t extra;
        uint32_t cp;
        if (lead >= 0xC2 && lead <= 0xDF) {
            extra = 1;
            cp = lead & 0x1F;
        } else if (lead >= 0xE0 && lead <= 0xEF) {
            extra = 2;
            cp = lead & 0x0F;
        } else if (lead >= 0xF0 && lead <= 0xF4) {
            extra = 3;
            cp = lead & 0x07;
        } else {
            return 0;
        }
        if (n - i - 1 < extra) return 0;
        for (size_t k = 1; k <= extra; k++) {
            uint8_t next = s[i + k];
            if ((next & 0xC0) != 0x80) return 0;
            cp = (cp << 6) | (next & 0x3F);
        }
        if (extra == 2 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) return 0;
        if (extra == 3 && (cp < 0x10000 || cp > 0x10FFFF)) return 0;
        i += extra + 1;
    }
    return 1;
}

static int check_key_value(const uint8_t *p, size_t n, int depth);

/* An AnyValue with at most one field set; *only is that field (number 0 when empty). */
static int check_any_value(const uint8_t *p, size_t n, int depth, Field *only) {
    Cursor c = {p, p + n};
    Field f;
    only->number = 0;
    if (depth > MAX_DEPTH) return 0;
    while (c.p < c.end) {
        if (!next_field(&c, &f) || only->number != 0) return 0;
        switch (f.number) {
        case 1: /* string_value */
            if (f.wire != WIRE_LEN || !valid_utf8(f.data, f.len)) return 0;
            break;
        case 2: /* bool_value */
        case 3: /* int_value */
            if (f.wire != WIRE_VARINT) return 0;
            break;
        case 4: /* double_value */
            if (f.wire != WIRE_I64) return 0;
            break;
        case 5: { /* array_value: ArrayValue { repeated AnyValue values = 1; } */
            if (f.wire != WIRE_LEN) return 0;
            Cursor a = {f.data, f.data + f.len};
            Field element, inner;
            while (a.p < a.end) {
                if (!next_field(&a, &element) || element.number != 1 || element.wire != WIRE_LEN) return 0;
                if (!check_any_value(element.data, element.len, depth + 1, &inner)) return 0;
            }
            break;
        }
        case 6: { /* kvlist_value: KeyValueList { repeated KeyValue values = 1; } */
            if (f.wire != WIRE_LEN) return 0;
            Cursor l = {f.data, f.data + f.len};
            Field entry;
            while (l.p < l.end) {
                if (!next_field(&l, &entry) || entry.number != 1 || entry.wire != WIRE_LEN) return 0;
                if (!check_key_value(entry.data, entry.len, depth + 1)) return 0;
            }
            break;
        }
        case 7: /* bytes_value */
            if (f.wire != WIRE_LEN) return 0;
            break;
        default:
            return 0;
        }
        *only = f;
    }
    return 1;
}

/* KeyValue { string key = 1; AnyValue value = 2; }, each at most once; the value is not
 * looked into (*value is the AnyValue's bytes). */
static int read_key_value(const uint8_t *p, size_t n, Field *key, Field *value, int *has_value) {
    Cursor c = {p, p + n};
    Field f;
    int has_key = 0;
    *has_value = 0;
    key->data = p;
    key->len = 0;
    while (c.p < c.end) {
        if (!next_field(&c, &f) || f.wire != WIRE_LEN) return 0;
        if (f.number == 1 && !has_key) {
            if (!valid_utf8(f.data, f.len)) return 0;
            *key = f;
            has_key = 1;
        } else if (f.number == 2 && !*has_value) {
            *value = f;
            *has_value = 1;
        } else {
            return 0;
        }
    }
    return 1;
}

/* A KeyValue whose value is checked all the way down. */
static int check_key_value(const uint8_t *p, size_t n, int depth) {
    Field key, value, only;
    int has_value;
    if (depth > MAX_DEPTH || !read_key_value(p, n, &key, &value, &has_value)) return 0;
    return !has_value || check_any_value(value.data, value.len, depth + 1, &only);
}

/* The one field of an AnyValue (number 0 when empty), without looking into it. */
static int any_value_field(const Field *value, int has_value, Field *only) {
    only->number = 0;
    if (!has_value) return 1;
    Cursor c = {value->data, value->data + value->len};
    Field f;
    while (c.p < c.end) {
        if (!next_field(&c, &f) || only->number != 0 || f.number < 1 || f.number > 7) return 0;
        *only = f;
    }
    return 1;
}

/* Every element exactly AnyValue{int_value} with a varint of at most 9 bytes (so >= 0). */
static int check_token_ids(const Field *array) {
    const uint8_t *p = array->data, *end = array->data + array->len;
    while (p < end) {
        if (end - p < 4 || p[0] != 0x0a) return 0;
        uint8_t size = p[1];
        if (size < 2 || size > 10 || (size_t)(end - p - 2) < size || p[2] != 0x18) return 0;
        const uint8_t *varint = p + 3, *last = p + 1 + size;
        for (const uint8_t *b = varint; b < last; b++)
            if (!(*b & 0x80)) return 0;
        if (*last & 0x80) return 0;
        p = last + 1;
    }
    return 1;
}

/* The packed form (instrumentation/packed_values.py): canonical base64 (A-Z a-z 0-9 + /, a
 * multiple of 4 characters, at most two '=' and only at the end) of whole values of value_size
 * bytes. Python's b64decode(validate=True) accepts all of these; anything else is left to it. */
static int check_packed(const Field *text, size_t value_size) {
    const uint8_t *p = text->data;
    size_t n = text->len, padding = 0;
    if (n % 4) return 0;
    if (n && p[n - 1] == '=') padding = (n >= 2 && p[n - 2] == '=') ? 2 : 1;
    for (size_t i = 0; i < n - padding; i++) {
        uint8_t b = p[i];
        if (!((b >= 'A' && b <= 'Z') || (b >= 'a' && b <= 'z') || (b >= '0' && b <= '9') || b == '+' || b == '/'))
            return 0;
    }
    return (n / 4 * 3 - padding) % value_size == 0;
}

/* A token-id or logprob attribute's value: an array the element loop checks, or the packed string. */
static int check_id_values(const Field *only, int (*check_array)(const Field *), size_t value_size) {
    if (only->number == 5 && only->wire == WIRE_LEN) return check_array(only);
    return only->number == 1 && only->wire == WIRE_LEN && check_packed(only, value_size);
}

/* Every element exactly AnyValue{double_value} or AnyValue{int_value}. */
static int check_logprobs(const Field *array) {
    Cursor c = {array->data, array->data + array->len};
    Field element, only;
    while (c.p < c.end) {
        if (!next_field(&c, &element) || element.number != 1 || element.wire != WIRE_LEN) return 0;
        if (!check_any_value(element.data, element.len, 1, &only)) return 0;
        if (only.number != 3 && only.number != 4) return 0;
    }
    return 1;
}

static int key_is(const Field *key, const char *name) {
    size_t n = strlen(name);
    return key->len == n && memcmp(key->data, name, n) == 0;
}

static int key_starts(const Field *key, const char *prefix) {
    size_t n = strlen(prefix);
    return key->len >= n && memcmp(key->data, prefix, n) == 0;
}

/* spanrl.llm.response.<digits>.token_ids -> 1, .logprobs -> 2, anything else under the prefix
 * -> 0, and -1 for a key the exact path's regular expression might read otherwise (it accepts
 * Unicode digits and a trailing newline): only [a-z0-9._] is decided here. */
static int response_key_kind(const Field *key, size_t prefix_len) {
    const uint8_t *p = key->data + prefix_len, *end = key->data + key->len;
    for (const uint8_t *b = p; b < end; b++)
        if (!((*b >= 'a' && *b <= 'z') || (*b >= '0' && *b <= '9') || *b == '.' || *b == '_')) return -1;
    const uint8_t *digits = p;
    while (p < end && *p >= '0' && *p <= '9') p++;
    if (p == digits) return 0;
    size_t rest = (size_t)(end - p);
    if (rest == 10 && memcmp(p, ".token_ids", 10) == 0) return 1;
    if (rest == 9 && memcmp(p, ".logprobs", 9) == 0) return 2;
    return 0;
}

/* One span attribute: the spanrl type rules (semconv.py) for spanrl keys, generic checks for
 * the rest. Typed values are read shallowly: a token-id array is walked once, by its own loop. */
static int check_attribute(const uint8_t *p, size_t n, SpanScan *out) {
    Field key, value, only;
    int has_value;
    if (!read_key_value(p, n, &key, &value, &has_value)) return 0;
    if (!key_starts(&key, "spanrl.")) return !has_value || check_any_value(value.data, value.len, 2, &only);
    if (!any_value_field(&value, has_value, &only)) return 0;
    if (key_is(&key, "spanrl.rollout.id") || key_is(&key, "spanrl.task.id")) {
        if (only.number != 1 || only.wire != WIRE_LEN || !valid_utf8(only.data, only.len)) return 0;
        if (key.len == strlen("spanrl.rollout.id")) {
            out->rollout_id = only.data;
            out->rollout_id_len = only.len;
            out->present |= HAS_ROLLOUT_ID;
        } else {
            out->task_id = only.data;
            out->task_id_len = only.len;
            out->present |= HAS_TASK_ID;
        }
        return 1;
    }
    if (key_is(&key, "spanrl.attempt")) {
        if (only.number != 3 || only.wire != WIRE_VARINT) return 0;
        out->attempt = (int64_t)only.varint;
        out->present |= HAS_ATTEMPT;
        return 1;
    }
    if (key_is(&key, "spanrl.llm.prompt_token_ids")) return check_id_values(&only, check_token_ids, 4);
    if (key_is(&key, "spanrl.llm.policy_version")) return only.number == 3 && only.wire == WIRE_VARINT;
    if (key_is(&key, "spanrl.llm.retokenized")) return only.number == 2 && only.wire == WIRE_VARINT;
    if (key_starts(&key, "spanrl.llm.response.")) {
        switch (response_key_kind(&key, strlen("spanrl.llm.response."))) {
        case 1:
            return check_id_values(&only, check_token_ids, 4);
        case 2:
            return check_id_values(&only, check_logprobs, 8);
        case -1:
            return 0;
        default:
            break;
        }
    }
    if (key_is(&key, "spanrl.agent.name")) out->present |= HAS_AGENT_NAME;
    return !has_value || check_any_value(value.data, value.len, 2, &only);
}

/* Span.Event { fixed64 time = 1; string name = 2; repeated KeyValue attributes = 3; uint32 dropped = 4; } */
static int check_event(const uint8_t *p, size_t n) {
    Cursor c = {p, p + n};
    Field f;
    while (c.p < c.end) {
        if (!next_field(&c, &f)) return 0;
        switch (f.number) {
        case 1: if (f.wire != WIRE_I64) return 0; break;
        case 2: if (f.wire != WIRE_LEN || !valid_utf8(f.data, f.len)) return 0; break;
        case 3: if (f.wire != WIRE_LEN || !check_key_value(f.data, f.len, 1)) return 0; break;
        case 4: if (f.wire != WIRE_VARINT) return 0; break;
        default: break; /* unknown: skipped, as protobuf does */
        }
    }
    return 1;
}

/* Span.Link { bytes trace_id = 1; bytes span_id = 2; string trace_state = 3;
 *             repeated KeyValue attributes = 4; uint32 dropped = 5; fixed32 flags = 6; } */
static int check_link(const uint8_t *p, size_t n) {
    Cursor c = {p, p + n};
    Field f;
    while (c.p < c.end) {
        if (!next_field(&c, &f)) return 0;
        switch (f.number) {
        case 1: case 2: if (f.wire != WIRE_LEN) return 0; break;
        case 3: if (f.wire != WIRE_LEN || !valid_utf8(f.data, f.len)) return 0; break;
        case 4: if (f.wire != WIRE_LEN || !check_key_value(f.data, f.len, 1)) return 0; break;
        case 5: if (f.wire != WIRE_VARINT) return 0; break;
        case 6: if (f.wire != WIRE_I32) return 0; break;
        default: break;
        }
    }
    return 1;
}

/* Status { string message = 2; StatusCode code = 3; } */
static int check_status(const uint8_t *p, size_t n) {
    Cursor c = {p, p + n};
    Field f;
    while (c.p < c.end) {
        if (!next_field(&c, &f)) return 0;
        switch (f.number) {
        case 2: if (f.wire != WIRE_LEN || !valid_utf8(f.data, f.len)) return 0; break;
        case 3: if (f.wire != WIRE_VARINT) return 0; break;
        default: break;
        }
    }
    return 1;
}

static int all_zero(const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i]) return 0;
    return 1;
}

static int scan(const uint8_t *p, size_t n, SpanScan *out) {
    Cursor c = {p, p + n};
    Field f;
    while (c.p < c.end) {
        if (!next_field(&c, &f)) return 0;
        switch (f.number) {
        case 1: /* trace_id; a repeated singular field: the last one counts */
            if (f.wire != WIRE_LEN) return 0;
            out->trace_id = f.data;
            out->trace_id_len = f.len;
            break;
        case 2: /* span_id */
            if (f.wire != WIRE_LEN) return 0;
            out->span_id = f.data;
            out->span_id_len = f.len;
            break;
        case 3: /* trace_state */
            if (f.wire != WIRE_LEN || !valid_utf8(f.data, f.len)) return 0;
            break;
        case 4: /* parent_span_id */
            if (f.wire != WIRE_LEN) return 0;
            out->parent_id = f.data;
            out->parent_id_len = f.len;
            break;
        case 5: /* name */
            if (f.wire != WIRE_LEN || !valid_utf8(f.data, f.len)) return 0;
            out->name = f.data;
            out->name_len = f.len;
            break;
        case 6: case 10: case 12: case 14: /* kind, dropped_*_count */
            if (f.wire != WIRE_VARINT) return 0;
            break;
        case 7: /* start_time_unix_nano, fixed64 little-endian */
            /* 2^63 ns or more: the Python path rejects it (SQLite integers are signed 64-bit) */
            if (f.wire != WIRE_I64 || (f.data[7] & 0x80)) return 0;
            out->start_ns = 0;
            for (int i = 7; i >= 0; i--) out->start_ns = (out->start_ns << 8) | f.data[i];
            break;
        case 8: /* end_time_unix_nano */
            if (f.wire != WIRE_I64 || (f.data[7] & 0x80)) return 0;
            break;
        case 9:
            if (f.wire != WIRE_LEN || !check_attribute(f.data, f.len, out)) return 0;
            break;
        case 11:
            if (f.wire != WIRE_LEN || !check_event(f.data, f.len)) return 0;
            break;
        case 13:
            if (f.wire != WIRE_LEN || !check_link(f.data, f.len)) return 0;
            break;
        case 15:
            if (f.wire != WIRE_LEN || !check_status(f.data, f.len)) return 0;
            break;
        case 16: /* flags */
            if (f.wire != WIRE_I32) return 0;
            break;
        default:
            break;
        }
    }
    if (out->trace_id_len != 16 || all_zero(out->trace_id, 16)) return 0;
    if (out->span_id_len != 8 || all_zero(out->span_id, 8)) return 0;
    if (out->parent_id_len != 0 && out->parent_id_len != 8) return 0;
    return 1;
}

static PyObject *optional_str(const uint8_t *data, size_t len, int present) {
    if (!present) Py_RETURN_NONE;
    return PyUnicode_DecodeUTF8((const char *)data, (Py_ssize_t)len, "strict");
}

static PyObject *scan_span(PyObject *module, PyObject *arg) {
    (void)module;
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "scan_span() takes the span's bytes");
        return NULL;
    }
    SpanScan s;
    memset(&s, 0, sizeof s);
    if (!scan((const uint8_t *)PyBytes_AS_STRING(arg), (size_t)PyBytes_GET_SIZE(arg), &s)) Py_RETURN_NONE;
    PyObject *attempt = (s.present & HAS_ATTEMPT) ? PyLong_FromLongLong(s.attempt) : Py_NewRef(Py_None);
    return Py_BuildValue(
        "(y#y#NKNNNi)",
        (const char *)s.trace_id, (Py_ssize_t)s.trace_id_len,
        (const char *)s.span_id, (Py_ssize_t)s.span_id_len,
        PyUnicode_DecodeUTF8((const char *)s.name, (Py_ssize_t)s.name_len, "strict"),
        (unsigned long long)s.start_ns,
        optional_str(s.rollout_id, s.rollout_id_len, s.present & HAS_ROLLOUT_ID),
        optional_str(s.task_id, s.task_id_len, s.present & HAS_TASK_ID),
        attempt,
        s.present);
}

static PyMethodDef methods[] = {
    {"scan_span", scan_span, METH_O,
     "scan_span(raw) -> (trace_id, span_id, name, start_ns, rollout_id, task_id, attempt, present)"
     " for a valid span, None when the exact Python validator must decide."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_span_scan", "One C pass over an OTLP span's wire bytes at ingest.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__span_scan(void) {
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    if (PyModule_AddIntConstant(module, "HAS_ROLLOUT_ID", HAS_ROLLOUT_ID) < 0 ||
        PyModule_AddIntConstant(module, "HAS_TASK_ID", HAS_TASK_ID) < 0 ||
        PyModule_AddIntConstant(module, "HAS_ATTEMPT", HAS_ATTEMPT) < 0 ||
        PyModule_AddIntConstant(module, "HAS_AGENT_NAME", HAS_AGENT_NAME) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
