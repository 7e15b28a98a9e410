/* The KV index's block -> holders table, flat: an open-addressing hash table (linear
 * probing, at most half full) from a block's 64-bit fingerprint (the first 8 bytes of its
 * chained hash, already uniformly random) to a bit mask of the nodes that hold it, `words`
 * 64-bit words, stored beside the key in one slot (16 bytes at up to 64 nodes). A probe is one
 * cache miss where a Python set costs two (its slot, then the key object it compares), and a
 * chain's probes do not depend on each other, so the walk prefetches ahead and the CPU overlaps
 * the misses. Fingerprint 0 marks an empty slot (a block whose fingerprint is 0 is stored as
 * 1); a block whose mask becomes all zero leaves by shifting its probe run back (no
 * tombstones). Single-threaded: the conductor's event loop owns it. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

typedef struct {
    uint64_t *slots; /* cap entries of 1 + words: the key, then its mask (one probe, one line) */
    uint64_t cap;    /* a power of two */
    uint64_t used;
    int words;
} fp_table;

#define KEY(t, i) ((t)->slots[(i) * (uint64_t)((t)->words + 1)])
#define MASK(t, i) ((t)->slots + (i) * (uint64_t)((t)->words + 1) + 1)

static inline uint64_t fp_at(const unsigned char *p) {
    uint64_t x;
    memcpy(&x, p, 8);
    return x ? x : 1;
}

#define HUGE_PAGE (2u << 20)

/* Zeroed slots; past a huge page's size, on huge pages where the kernel gives them (a walk's
 * probes land on random pages of a table of tens of MB: 4 kB pages would miss the TLB on each). */
static uint64_t *zeroed(uint64_t bytes) {
    void *p = NULL;
    if (bytes < HUGE_PAGE)
        return calloc(bytes, 1);
    bytes = (bytes + HUGE_PAGE - 1) & ~(uint64_t)(HUGE_PAGE - 1);
    if (posix_memalign(&p, HUGE_PAGE, bytes) != 0)
        return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE); /* advice only: without it the table works the same */
#endif
    return memset(p, 0, bytes);
}

static int alloc_slots(fp_table *t, uint64_t cap, int words) {
    uint64_t *slots = zeroed(cap * (uint64_t)(words + 1) * sizeof(uint64_t));
    if (!slots)
        return -1;
    t->slots = slots;
    t->cap = cap;
    t->words = words;
    t->used = 0;
    return 0;
}

static inline uint64_t find_slot(const fp_table *t, uint64_t fp) {
    uint64_t m = t->cap - 1, i = fp & m;
    while (KEY(t, i) && KEY(t, i) != fp)
        i = (i + 1) & m;
    return i; /* the key's slot, or the empty slot where it would go */
}

/* Rebuild into `cap` slots of `words` words each (more slots, or wider masks). */
static int rehash(fp_table *t, uint64_t cap, int words) {
    fp_table old = *t;
    if (alloc_slots(t, cap, words) != 0) {
        *t = old;
        return -1;
    }
    int keep = old.words < words ? old.words : words;
    for (uint64_t i = 0; i < old.cap; i++) {
        if (!KEY(&old, i))
            continue;
        uint64_t j = find_slot(t, KEY(&old, i));
        KEY(t, j) = KEY(&old, i);
        memcpy(MASK(t, j), MASK(&old, i), keep * sizeof(uint64_t));
        t->used++;
    }
    free(old.slots);
    return 0;
}

fp_table *mooncake_fp_new(int words) {
    fp_table *t = calloc(1, sizeof(fp_table));
    if (!t || alloc_slots(t, 1024, words < 1 ? 1 : words) != 0) {
        free(t);
        return NULL;
    }
    return t;
}

void mooncake_fp_free(fp_table *t) {
    if (!t)
        return;
    free(t->slots);
    free(t);
}

uint64_t mooncake_fp_len(const fp_table *t) { return t->used; }

/* Widen every mask to `words` words (a node bit past the current width). */
int mooncake_fp_widen(fp_table *t, int words) {
    return words <= t->words ? 0 : rehash(t, t->cap, words);
}

/* Set `bit` on the `n` blocks whose hashes lie `stride` bytes apart in `data`. */
int mooncake_fp_add(fp_table *t, int bit, const unsigned char *data, int64_t stride, int64_t n) {
    if (bit < 0 || bit >= 64 * t->words)
        return -1;
    int w = bit >> 6;
    uint64_t b = 1ull << (bit & 63);
    for (int64_t k = 0; k < n; k++) {
        if ((t->used + 1) * 2 > t->cap && rehash(t, t->cap * 2, t->words) != 0)
            return -1;
        uint64_t fp = fp_at(data + k * stride), i = find_slot(t, fp);
        if (!KEY(t, i)) {
            KEY(t, i) = fp;
            t->used++;
        }
        MASK(t, i)[w] |= b;
    }
    return 0;
}

static int mask_empty(const fp_table *t, uint64_t i) {
    for (int w = 0; w < t->words; w++)
        if (MASK(t, i)[w])
            return 0;
    return 1;
}

/* Delete slot i, shifting later members of its probe run back into the hole. */
static void delete_slot(fp_table *t, uint64_t i) {
    uint64_t m = t->cap - 1, j = i;
    for (;;) {
        j = (j + 1) & m;
        if (!KEY(t, j))
            break;
        uint64_t home = KEY(t, j) & m;
        /* j's entry may move to i when its home is not cyclically in (i, j] */
        if ((j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)) {
            KEY(t, i) = KEY(t, j);
            memcpy(MASK(t, i), MASK(t, j), t->words * sizeof(uint64_t));
            i = j;
        }
    }
    KEY(t, i) = 0;
    memset(MASK(t, i), 0, t->words * sizeof(uint64_t));
    t->used--;
}

/* Clear `bit` on the given blocks; a block nobody holds any more leaves the table. */
int mooncake_fp_remove(fp_table *t, int bit, const unsigned char *data, int64_t stride, int64_t n) {
    if (bit < 0 || bit >= 64 * t->words)
        return -1;
    int w = bit >> 6;
    uint64_t b = 1ull << (bit & 63);
    for (int64_t k = 0; k < n; k++) {
        uint64_t i = find_slot(t, fp_at(data + k * stride));
        if (!KEY(t, i))
            continue;
        MASK(t, i)[w] &= ~b;
        if (mask_empty(t, i))
            delete_slot(t, i);
    }
    return 0;
}

/* Clear `bit` everywhere (a node forgotten); rebuilt without the blocks left empty. */
int mooncake_fp_clear_bit(fp_table *t, int bit) {
    if (bit < 0 || bit >= 64 * t->words)
        return -1;
    int w = bit >> 6;
    uint64_t b = 1ull << (bit & 63);
    uint64_t emptied = 0;
    for (uint64_t i = 0; i < t->cap; i++) {
        if (KEY(t, i) && (MASK(t, i)[w] & b)) {
            MASK(t, i)[w] &= ~b;
            if (mask_empty(t, i)) {
                KEY(t, i) = 0; /* holes break probe runs: the rehash below restores them */
                emptied++;
            }
        }
    }
    if (!emptied)
        return 0;
    t->used -= emptied;
    return rehash(t, t->cap, t->words);
}

/* Walk a chain of `n` blocks: for each node holding block 0, how many leading blocks it holds
 * without a gap (`pairs_out[2k]` its bit, `pairs_out[2k + 1]` its run, k < the return value; at
 * most 64 * words pairs), and in `*store_end` the first block that no node of `store_bits` (a
 * `words`-word mask) holds. */
int mooncake_fp_walk(const fp_table *t, const unsigned char *data, int64_t stride, int64_t n,
                     const uint64_t *store_bits, int64_t *pairs_out, int64_t *store_end) {
    int words = t->words, found = 0;
    uint64_t alive[words];
    int64_t se = -1;
    *store_end = 0;
    if (n <= 0)
        return 0;
    uint64_t i0 = find_slot(t, fp_at(data));
    if (!KEY(t, i0))
        return 0;
    int any_store = 0;
    for (int w = 0; w < words; w++) {
        alive[w] = MASK(t, i0)[w];
        any_store |= (alive[w] & store_bits[w]) != 0;
    }
    if (!any_store)
        se = 0;
    int64_t k = 1;
    for (; k < n; k++) {
        if (k + 8 < n)
            __builtin_prefetch(&KEY(t, fp_at(data + (k + 8) * stride) & (t->cap - 1)));
        uint64_t i = find_slot(t, fp_at(data + k * stride));
        const uint64_t *m = MASK(t, i);
        int live = 0, stores = 0;
        for (int w = 0; w < words; w++) {
            uint64_t held = KEY(t, i) ? m[w] : 0, ended = alive[w] & ~held;
            while (ended) {
                int b = __builtin_ctzll(ended);
                ended &= ended - 1;
                pairs_out[2 * found] = w * 64 + b;
                pairs_out[2 * found++ + 1] = k;
            }
            alive[w] &= held;
            live |= alive[w] != 0;
            stores |= (held & store_bits[w]) != 0;
        }
        if (se < 0 && !stores)
            se = k;
        if (!live && se >= 0)
            break;
    }
    for (int w = 0; w < words; w++) {
        uint64_t left = alive[w];
        while (left) {
            int b = __builtin_ctzll(left);
            left &= left - 1;
            pairs_out[2 * found] = w * 64 + b;
            pairs_out[2 * found++ + 1] = n;
        }
    }
    *store_end = se < 0 ? n : se;
    return found;
}
