/* Lays out OTLP/JSON span objects from byte pieces: the loop that export/otlp_json.py's numpy index
 * program (Pieces + Arrow take) spells out as a dozen array passes per attribute value, written once.
 *
 * Nothing here knows JSON. Every text is prepared by the caller (hex ids, number texts, escaped
 * strings, key prefixes); this only copies them in row order:
 *
 *   row r = fixed[0](r) fixed[1](r) ... then, for each attribute present on r (in column order),
 *           its prefix (variant 0 when it is the row's first, else 1 + the previous value's class)
 *           and its value text; then closing[0] (no attribute) or closing[1 + last class].
 *
 * A binary source is (offsets, data): element i is data[offs[i] .. offs[i + 1]). A fixed source's
 * element for row r is r (mode 0), 0 (mode 1: a constant) or index[r] (mode 2). Attribute j's
 * attr_count[j] values belong, in order, to the rows where attr_valid[j][r] is set (every row when
 * attr_valid[j] is NULL); attr_cursor[j] is the next one, kept across calls so a chunk is laid out
 * part by part.
 *
 * Rows [r0, r1) are written to out while they fit in cap bytes; row_end[i] is where row r0 + i ends.
 * Returns the number of rows written (0: the first row alone is larger than cap). No allocation.
 */
#include <stdint.h>
#include <string.h>

typedef struct {
    const int64_t *offs;
    const uint8_t *data;
} bin_t;

static inline int64_t bin_len(const bin_t *b, int64_t i) { return b->offs[i + 1] - b->offs[i]; }

/* Most texts are short (a key prefix, a number): those are copied with two overlapping fixed-size
 * moves, which the compiler inlines, instead of a call to memcpy each. Nothing outside [s, s + n)
 * is read and nothing outside [d, d + n) is written. */
static inline void copy(uint8_t *d, const uint8_t *s, int64_t n)
{
    if (n >= 8 && n <= 16) {
        memcpy(d, s, 8);
        memcpy(d + n - 8, s + n - 8, 8);
    } else if (n >= 4 && n < 8) {
        memcpy(d, s, 4);
        memcpy(d + n - 4, s + n - 4, 4);
    } else if (n > 16 && n <= 32) {
        memcpy(d, s, 16);
        memcpy(d + n - 16, s + n - 16, 16);
    } else if (n > 32) {
        memcpy(d, s, (size_t)n);
    } else {
        while (n-- > 0) *d++ = *s++;
    }
}

int64_t plasmient_json_assemble(
    int64_t r0, int64_t r1,
    int32_t n_fixed, const int8_t *fixed_mode, const bin_t *fixed, const int64_t *const *fixed_index,
    int32_t n_attr, const uint8_t *const *attr_valid, const int64_t *attr_count, int64_t *attr_cursor,
    const bin_t *values, const int32_t *attr_class, const bin_t *prefixes, const bin_t *closing,
    uint8_t *out, int64_t cap, int64_t *row_end)
{
    int64_t pos = 0;
    for (int64_t r = r0; r < r1; r++) {
        int ok = 1;
        for (int32_t f = 0; f < n_fixed && ok; f++) {
            int64_t e = fixed_mode[f] == 0 ? r : fixed_mode[f] == 1 ? 0 : fixed_index[f][r];
            int64_t len = bin_len(&fixed[f], e);
            if (pos + len > cap) { ok = 0; break; }
            copy(out + pos, fixed[f].data + fixed[f].offs[e], len);
            pos += len;
        }
        int32_t last = -1;
        /* the cursors move only once the whole row has fitted (below) */
        for (int32_t j = 0; j < n_attr && ok; j++) {
            if (attr_valid[j] != 0 && !attr_valid[j][r]) continue;
            int64_t k = attr_cursor[j];
            if (k >= attr_count[j]) continue;
            const bin_t *p = &prefixes[j];
            int64_t variant = last < 0 ? 0 : 1 + last;
            int64_t plen = bin_len(p, variant), vlen = bin_len(&values[j], k);
            if (pos + plen + vlen > cap) { ok = 0; break; }
            copy(out + pos, p->data + p->offs[variant], plen);
            pos += plen;
            copy(out + pos, values[j].data + values[j].offs[k], vlen);
            pos += vlen;
            last = attr_class[j];
        }
        if (ok) {
            int64_t c = last < 0 ? 0 : 1 + last;
            int64_t clen = bin_len(closing, c);
            if (pos + clen > cap) ok = 0;
            else { copy(out + pos, closing->data + closing->offs[c], clen); pos += clen; }
        }
        if (!ok) return r - r0;  /* this row does not fit: it is left, cursors untouched, for the next call */
        for (int32_t j = 0; j < n_attr; j++) {
            if ((attr_valid[j] == 0 || attr_valid[j][r]) && attr_cursor[j] < attr_count[j]) attr_cursor[j]++;
        }
        row_end[r - r0] = pos;
    }
    return r1 - r0;
}
