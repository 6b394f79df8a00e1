/*
 * lora.c — a LoRA adapter file read against a model's weight table (lora.h): its keys in
 * diffusers/peft form (`[transformer.|base_model.model.]MODULE.lora_A.weight` / `lora_B.weight`,
 * `lora_down` / `lora_up`, optional `MODULE.alpha`, an optional `lora_B.bias`, diffusers'
 * `lora_adapter_metadata`) mapped onto the table's linears, every key accounted for, then each
 * rank's slices of the factors read shard-on-read. The scale of each module is what peft
 * computes: alpha / r (alpha / sqrt r with rsLoRA), its alpha resolved as peft resolves
 * `alpha_pattern` against the module's name, and alpha = r (scale 1) when the file gives none.
 * Not here: fusing (lora_fuse.c), other naming schemes (kohya `lora_unet_*`, BFL/ComfyUI
 * `diffusion_model.*`, XLabs: the Python drop-in converts them with diffusers' own converters).
 */
#include "models/lora.h"

#include "io/json.h"
#include "models/info.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- one key in words ---- */
typedef enum { K_A, K_B, K_BIAS, K_ALPHA, K_OTHER } key_kind;

/* Adapter kinds that are not LoRA, by a piece of their key names, in words for the message. */
static const char *other_kind(const char *key) {
    static const struct {
        const char *piece, *what;
    } kinds[] = {
        {"lora_magnitude_vector", "DoRA (weight-decomposed LoRA, peft use_dora)"},
        {"dora_scale", "DoRA (weight-decomposed LoRA)"},
        {".lokr_", "LoKr (LyCORIS Kronecker factors)"},
        {".hada_", "LoHa (LyCORIS Hadamard factors)"},
        {".oft_", "OFT (orthogonal fine-tuning)"},
        {".boft_", "BOFT (orthogonal butterfly factors)"},
        {".lora_mid.", "LoCon with a Tucker mid factor (LyCORIS lora_mid)"},
        {".ia3_", "IA3"},
    };
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        if (strstr(key, kinds[i].piece))
            return kinds[i].what;
    const size_t n = strlen(key);
    if ((n > 5 && strcmp(key + n - 5, ".diff") == 0) ||
        (n > 7 && strcmp(key + n - 7, ".diff_b") == 0))
        return "full weight differences (.diff / .diff_b)";
    return NULL;
}

/* The module a key adapts and what the key holds; the module is written to mod. */
static key_kind parse_key(const char *key, char *mod, size_t cap) {
    static const struct {
        const char *suffix;
        key_kind k;
    } sfx[] = {{".lora_A.weight", K_A},  {".lora_B.weight", K_B},  {".lora_down.weight", K_A},
               {".lora_up.weight", K_B}, {".lora_B.bias", K_BIAS}, {".lora_up.bias", K_BIAS},
               {".alpha", K_ALPHA}};
    const char *s = key;
    if (strncmp(s, "base_model.model.", 17) == 0)
        s += 17;
    if (strncmp(s, "transformer.", 12) == 0)
        s += 12;
    const size_t n = strlen(s);
    for (size_t i = 0; i < sizeof sfx / sizeof sfx[0]; i++) {
        const size_t ls = strlen(sfx[i].suffix);
        if (n > ls && n - ls < cap && strcmp(s + n - ls, sfx[i].suffix) == 0) {
            memcpy(mod, s, n - ls);
            mod[n - ls] = 0;
            return sfx[i].k;
        }
    }
    snprintf(mod, cap, "%s", s);
    return K_OTHER;
}

/* ---- the table by name ---- */
typedef struct {
    const char *name;
    int i;
} name_ix;
static int cmp_name_ix(const void *a, const void *b) {
    return strcmp(((const name_ix *)a)->name, ((const name_ix *)b)->name);
}
static int table_find(const name_ix *ix, int n, const char *name) {
    const name_ix key = {name, -1};
    const name_ix *hit = bsearch(&key, ix, (size_t)n, sizeof key, cmp_name_ix);
    return hit ? hit->i : -1;
}

/* A growing list of names for one message, cut before it outgrows the message buffer. */
typedef struct {
    char buf[1400];
    int n, shown;
} name_list;
static void list_add(name_list *l, const char *name) {
    char esc[MDT_ESC_NAME];
    mdt_escape(name, esc, sizeof esc);
    const size_t len = strlen(l->buf);
    if (len + strlen(esc) + 8 < sizeof l->buf) {
        snprintf(l->buf + len, sizeof l->buf - len, "%s'%s'", l->n ? ", " : "", esc);
        l->shown++;
    }
    l->n++;
}
static const char *list_more(const name_list *l, char *buf, size_t cap) {
    if (l->n > l->shown)
        snprintf(buf, cap, " and %d more", l->n - l->shown);
    else
        buf[0] = 0;
    return buf;
}

/* ---- scales: peft's LoraConfig (r, lora_alpha, alpha_pattern, rank_pattern, use_rslora) ---- */
typedef struct {
    const cJSON *meta;    /* lora_adapter_metadata, or NULL */
    const char *pfx;      /* "transformer." when its keys carry the component, else "" */
    double lora_alpha;    /* the default alpha (any sign: peft scales by it as given) */
    int alpha_given;      /* 0: none given (alpha = r: no metadata and no .alpha keys) */
    double r;             /* the metadata's default rank (peft's 8 if it gives none); < 0: none */
    int r_given;          /* the metadata names r */
    const cJSON *alpha_p; /* {pattern: alpha} */
    const cJSON *rank_p;  /* {pattern: rank} */
    int rslora;
} lora_cfg;

static const cJSON *meta_get(const lora_cfg *c, const char *field) {
    char k[96];
    snprintf(k, sizeof k, "%s%s", c->pfx, field);
    return cJSON_GetObjectItemCaseSensitive(c->meta, k);
}

/* A pattern key, written for Python's re, as a POSIX extended expression with the same matches
 * over module names, into out (cap bytes): \d and \D become [0-9] and [^0-9], and an escaped
 * punctuation character the character itself in brackets ([.]); \w \W \s \S \b \B pass
 * (glibc reads them as Python does on ASCII names). 0 when the key uses what has no such
 * spelling: another escape, a backslash inside a bracket expression (POSIX reads it as itself,
 * Python as an escape), or Python's (? groups. */
static int python_to_ere(const char *key, char *out, size_t cap) {
    size_t k = 0;
    int in_bracket = 0;
    for (const char *p = key; *p; p++) {
        char piece[8] = {0};
        if (in_bracket) {
            if (*p == '\\')
                return 0;
            in_bracket = *p != ']' || p[-1] == '[' || (p[-1] == '^' && p[-2] == '[');
            piece[0] = *p;
        } else if (*p == '[') {
            in_bracket = 1, piece[0] = '[';
        } else if (*p == '(' && p[1] == '?') {
            return 0;
        } else if (*p == '\\') {
            const char c = *++p;
            if (c == 'd' || c == 'D')
                snprintf(piece, sizeof piece, "%s", c == 'd' ? "[0-9]" : "[^0-9]");
            else if (c && strchr("wWsSbB\\^", c)) /* as they are: glibc's \w..., \\ and \^ */
                piece[0] = '\\', piece[1] = c;
            else if (c && strchr(".$|?*+()[]{}/-_:,=<>!@#%&~'\"", c))
                piece[0] = '[', piece[1] = c, piece[2] = ']';
            else
                return 0;
        } else {
            piece[0] = *p;
        }
        const size_t n = strlen(piece);
        if (k + n + 1 > cap)
            return 0;
        memcpy(out + k, piece, n + 1);
        k += n;
    }
    return 1;
}

/* peft's get_pattern_key: the first key of `patterns` with re.match(rf"(.*\.)?({key})$", mod). */
static mdt_status pattern_value(const cJSON *patterns, const char *mod, const char *src,
                                const char *what, double *out, int *found) {
    *found = 0;
    const cJSON *p;
    char shown[MDT_ESC_NAME];
    cJSON_ArrayForEach(p, patterns) {
        char re[6 * MDT_NAME_MAX + 32], ere[5 * MDT_NAME_MAX];
        regex_t rx;
        const int spelled = python_to_ere(p->string, ere, sizeof ere);
        snprintf(re, sizeof re, "^(.*\\.)?(%s)$", ere);
        if (!spelled || regcomp(&rx, re, REG_EXTENDED | REG_NOSUB) != 0)
            return MDT_FAIL(MDT_E_UNSUPPORTED,
                            "%s: lora_adapter_metadata: %s key '%s' is not a regular expression "
                            "meshdit reads as Python's re does (POSIX extended syntax, \\d \\w "
                            "\\s \\b and escaped punctuation; no (?...) groups, no backslash "
                            "inside [...])",
                            src, what, mdt_escape(p->string, shown, sizeof shown));
        const int hit = regexec(&rx, mod, 0, NULL, 0) == 0;
        regfree(&rx);
        if (hit) {
            if (!cJSON_IsNumber(p))
                return MDT_FAIL(MDT_E_FORMAT, "%s: lora_adapter_metadata: %s['%s'] is not a number",
                                src, what, mdt_escape(p->string, shown, sizeof shown));
            *out = p->valuedouble;
            *found = 1;
            return MDT_OK;
        }
    }
    return MDT_OK;
}

/* A pattern table as a file (or a server's client) may give it: at most MDT_LORA_PATTERNS_MAX
 * keys of at most MDT_NAME_MAX bytes, none with a back-reference (\\1 .. \\9: the one regex
 * feature whose matching can take exponential time), so matching stays bounded. */
#define MDT_LORA_PATTERNS_MAX 4096
static mdt_status check_patterns(const cJSON *patterns, const char *src, const char *what) {
    char shown[MDT_ESC_NAME];
    int n = 0;
    const cJSON *p;
    cJSON_ArrayForEach(p, patterns) {
        if (++n > MDT_LORA_PATTERNS_MAX)
            return MDT_FAIL(MDT_E_UNSUPPORTED,
                            "%s: lora_adapter_metadata: %s has more than %d keys", src, what,
                            MDT_LORA_PATTERNS_MAX);
        const char *k = p->string;
        int backref = 0;
        for (const char *q = k; q[0] && q[1] && !backref; q++)
            backref = q[0] == '\\' && q[1] >= '1' && q[1] <= '9';
        if (strlen(k) >= MDT_NAME_MAX || backref)
            return MDT_FAIL(MDT_E_UNSUPPORTED, "%s: lora_adapter_metadata: %s key '%s' is %s", src,
                            what, mdt_escape(k, shown, sizeof shown),
                            backref ? "a regular expression with a back-reference"
                                    : "longer than a module name");
    }
    return MDT_OK;
}

/* The LoraConfig fields read here; a file's metadata may hold any of peft's others. */
static const struct {
    const char *field;
    int type; /* 0 number, 1 bool, 2 object */
} k_fields[] = {{"lora_alpha", 0},    {"r", 0},           {"use_dora", 1}, {"use_rslora", 1},
                {"alpha_pattern", 2}, {"rank_pattern", 2}};

/* The metadata's view as diffusers takes it. A pipeline's file (save_lora_weights) prefixes
 * every field with its component, "transformer.", and the pipeline's loader keeps only those
 * (load_lora_adapter with prefix "transformer": the others are dropped); a transformer's own
 * file (save_lora_adapter) has them bare. Any "transformer." key selects the prefixed view; a
 * bare LoraConfig field beside it would be dropped by diffusers, so it is refused here. */
static mdt_status meta_prefix(const cJSON *meta, const char *src, const char **pfx) {
    const cJSON *v;
    *pfx = "";
    cJSON_ArrayForEach(v, meta) {
        if (strncmp(v->string, "transformer.", 12) == 0) {
            *pfx = "transformer.";
            break;
        }
    }
    for (size_t i = 0; **pfx && i < sizeof k_fields / sizeof k_fields[0]; i++)
        if (cJSON_GetObjectItemCaseSensitive(meta, k_fields[i].field))
            return MDT_FAIL(MDT_E_INVALID,
                            "%s: lora_adapter_metadata has both 'transformer.'-prefixed fields and "
                            "a bare '%s' (diffusers' pipeline loader reads the prefixed ones only "
                            "and would drop it)",
                            src, k_fields[i].field);
    return MDT_OK;
}

/* Every value of a pattern table: a finite number (rank_pattern: a positive integer rank). */
static mdt_status check_pattern_values(const cJSON *patterns, const char *src, const char *pfx,
                                       const char *what) {
    char shown[MDT_ESC_NAME];
    const cJSON *p;
    const int rank = strcmp(what, "rank_pattern") == 0;
    cJSON_ArrayForEach(p, patterns) {
        const double v = cJSON_IsNumber(p) ? p->valuedouble : NAN;
        const int ok = rank ? v >= 1 && v <= 1e9 && v == floor(v) : isfinite(v);
        if (!ok)
            return MDT_FAIL(cJSON_IsNumber(p) ? MDT_E_INVALID : MDT_E_FORMAT,
                            "%s: lora_adapter_metadata: %s%s['%s'] is %s", src, pfx, what,
                            mdt_escape(p->string, shown, sizeof shown),
                            !cJSON_IsNumber(p) ? "not a number"
                            : rank             ? "not a rank (a positive integer)"
                                               : "not finite");
    }
    return MDT_OK;
}

/* peft's LoraConfig defaults, which diffusers' loader takes for a field the metadata leaves out
 * (LoraConfig(**metadata)). */
static const double k_peft_r = 8, k_peft_alpha = 8;

static mdt_status cfg_from_meta(const cJSON *meta, const char *src, lora_cfg *c) {
    memset(c, 0, sizeof *c);
    c->lora_alpha = -1, c->r = -1;
    if (!meta)
        return MDT_OK;
    c->meta = meta;
    MDT_TRY(meta_prefix(meta, src, &c->pfx));
    const cJSON *v;
    /* a field of the wrong type is refused, never read as absent (peft would fail on it) */
    static const char *const tname[] = {"a number", "true or false", "an object"};
    for (size_t i = 0; i < sizeof k_fields / sizeof k_fields[0]; i++) {
        if (!(v = meta_get(c, k_fields[i].field)))
            continue;
        const int ok = k_fields[i].type == 0   ? cJSON_IsNumber(v)
                       : k_fields[i].type == 1 ? cJSON_IsBool(v)
                                               : cJSON_IsObject(v);
        if (!ok)
            return MDT_FAIL(MDT_E_FORMAT, "%s: lora_adapter_metadata: %s%s is not %s", src, c->pfx,
                            k_fields[i].field, tname[k_fields[i].type]);
    }
    if ((v = meta_get(c, "use_dora")) && cJSON_IsTrue(v))
        return MDT_FAIL(MDT_E_UNSUPPORTED,
                        "%s: the adapter is DoRA (weight-decomposed LoRA, %suse_dora in its "
                        "lora_adapter_metadata): meshdit fuses plain LoRA only",
                        src, c->pfx);
    /* absent: peft's defaults, as diffusers builds the LoraConfig from the metadata */
    c->lora_alpha = k_peft_alpha, c->alpha_given = 1, c->r = k_peft_r;
    if ((v = meta_get(c, "lora_alpha")) && cJSON_IsNumber(v))
        c->lora_alpha = v->valuedouble;
    if (!isfinite(c->lora_alpha))
        return MDT_FAIL(MDT_E_INVALID, "%s: lora_adapter_metadata: %slora_alpha is not finite", src,
                        c->pfx);
    if ((v = meta_get(c, "r")) && cJSON_IsNumber(v)) {
        c->r = v->valuedouble;
        if (!(c->r >= 1 && c->r <= 1e9 && c->r == floor(c->r)))
            return MDT_FAIL(MDT_E_INVALID,
                            "%s: lora_adapter_metadata: %sr is %g: a rank is a positive integer",
                            src, c->pfx, c->r);
        c->r_given = 1;
    }
    if ((v = meta_get(c, "use_rslora")) && cJSON_IsTrue(v))
        c->rslora = 1;
    if ((v = meta_get(c, "alpha_pattern")) && cJSON_IsObject(v))
        c->alpha_p = v;
    if ((v = meta_get(c, "rank_pattern")) && cJSON_IsObject(v))
        c->rank_p = v;
    MDT_TRY(check_patterns(c->alpha_p, src, "alpha_pattern"));
    MDT_TRY(check_patterns(c->rank_p, src, "rank_pattern"));
    MDT_TRY(check_pattern_values(c->alpha_p, src, c->pfx, "alpha_pattern"));
    return check_pattern_values(c->rank_p, src, c->pfx, "rank_pattern");
}

/* ---- mapping ---- */
typedef struct {
    char mod[MDT_NAME_MAX];
    const mdt_st_entry *a, *b, *bias, *alpha;
    int wi, bi;
} mod_rec;

static mod_rec *rec_of(mod_rec *r, int *n, const char *mod) {
    for (int i = *n - 1; i >= 0; i--)
        if (strcmp(r[i].mod, mod) == 0)
            return &r[i];
    mod_rec *x = &r[(*n)++];
    memset(x, 0, sizeof *x);
    snprintf(x->mod, sizeof x->mod, "%s", mod);
    x->wi = x->bi = -1;
    return x;
}

static int64_t numel_of(const mdt_st_entry *e) {
    int64_t n = 1;
    for (int d = 0; d < e->ndim; d++)
        n *= e->shape[d];
    return n;
}

/* A [r, in] and B [out, r] of weight w (a Conv3d kept as a linear: A [r, in, kt, kh, kw] and
 * B [out, r, 1, 1, 1], peft's conv LoRA, whose product is the linear's delta). */
static mdt_status check_shapes(const mdt_weight_spec *w, const mod_rec *x, const char *src,
                               int64_t *rank) {
    char s1[96], s2[96];
    int64_t st[MDT_MAX_DIMS];
    const int nd = mdt_weight_stored_shape(w, st);
    const mdt_st_entry *a = x->a, *b = x->b;
    const int64_t r = a->ndim >= 2 ? a->shape[0] : -1;
    /* the factors' expected shapes with r taken from A */
    int64_t wa[MDT_MAX_DIMS], wb[MDT_MAX_DIMS];
    wa[0] = r, wb[0] = st[0];
    for (int d = 1; d < nd; d++)
        wa[d] = st[d], wb[d] = d == 1 ? r : 1;
    int oka = a->ndim == nd && r >= 1, okb = b->ndim == nd;
    for (int d = 1; oka && d < nd; d++)
        oka = a->shape[d] == wa[d];
    for (int d = 0; okb && d < nd; d++)
        okb = b->shape[d] == wb[d];
    if (!oka || !okb) {
        const mdt_st_entry *e = !oka ? a : b;
        const int64_t *want = !oka ? wa : wb;
        char esc[MDT_ESC_NAME];
        mdt_escape(e->name, esc, sizeof esc);
        if (r < 1) { /* A's shape with its rank r >= 1 open: [r, in] or [r, in, kt, kh, kw] */
            char ra[96];
            int len = snprintf(ra, sizeof ra, "[r");
            for (int d = 1; d < nd && len < (int)sizeof ra; d++)
                len += snprintf(ra + len, sizeof ra - (size_t)len, ", %lld", (long long)st[d]);
            return MDT_FAIL(MDT_E_INVALID,
                            "%s: '%s' has shape %s, which does not fit '%s' %s: lora_A must be "
                            "%s] with r >= 1",
                            src, esc, mdt_shape_str(e->ndim, e->shape, s1, 96), w->name,
                            mdt_shape_str(nd, st, s2, 96), ra);
        }
        char s3[96];
        return MDT_FAIL(MDT_E_INVALID,
                        "%s: '%s' has shape %s, which does not fit '%s' %s (rank %lld from "
                        "lora_A): expected %s",
                        src, esc, mdt_shape_str(e->ndim, e->shape, s1, 96), w->name,
                        mdt_shape_str(nd, st, s2, 96), (long long)r,
                        mdt_shape_str(nd, want, s3, 96));
    }
    if (x->bias && !(x->bias->ndim == 1 && x->bias->shape[0] == st[0])) {
        char esc[MDT_ESC_NAME];
        mdt_escape(x->bias->name, esc, sizeof esc);
        return MDT_FAIL(MDT_E_INVALID,
                        "%s: '%s' has shape %s, which does not fit the bias of '%s': expected "
                        "[%lld], its output features",
                        src, esc, mdt_shape_str(x->bias->ndim, x->bias->shape, s1, 96), x->mod,
                        (long long)st[0]);
    }
    *rank = r;
    return MDT_OK;
}

/* The value of a one-element float tensor (an alpha). */
static mdt_status scalar_of(const mdt_st_file *f, const mdt_st_entry *e, double *out) {
    char esc[MDT_ESC_NAME];
    mdt_escape(e->name, esc, sizeof esc);
    if (!mdt_dtype_is_float(e->dtype) || numel_of(e) != 1)
        return MDT_FAIL(MDT_E_FORMAT, "%s: '%s' must be one float (an alpha), not %s of %lld",
                        f->path, esc, mdt_dtype_name(e->dtype), (long long)numel_of(e));
    float v;
    MDT_TRY(mdt_st_read_f32(f, e, 0, 1, &v));
    if (!isfinite(v))
        return MDT_FAIL(MDT_E_FORMAT, "%s: '%s' is NaN, Inf or beyond float32's range", f->path,
                        esc);
    *out = v;
    return MDT_OK;
}

/* Every module's scale, as peft's LoraConfig (from the metadata, or as diffusers builds it from
 * the `.alpha` keys: the most common alpha as lora_alpha, the others as alpha_pattern keyed by
 * the module's name) computes it: alpha_m / r_m. */
static mdt_status resolve_scales(const mdt_st_file *f, const char *src, const cJSON *meta,
                                 const mod_rec *rec, mdt_lora_target *t, int n) {
    lora_cfg c;
    MDT_TRY(cfg_from_meta(meta, src, &c));
    cJSON *alphas = NULL; /* the .alpha keys as a config: {module: alpha} */
    double *av = NULL;
    int nalpha = 0;
    for (int i = 0; i < n; i++)
        nalpha += rec[i].alpha != NULL;
    mdt_status st = MDT_OK;
    if (nalpha && meta)
        return MDT_FAIL(MDT_E_INVALID,
                        "%s: the adapter gives alphas both as '.alpha' keys and in its "
                        "lora_adapter_metadata (diffusers refuses that too)",
                        src);
    if (nalpha) {
        av = mdt_calloc(sizeof(double) * (size_t)n);
        alphas = cJSON_CreateObject();
        if (!av || !alphas)
            st = MDT_FAIL(MDT_E_NOMEM, "out of memory");
        for (int i = 0; st == MDT_OK && i < n; i++)
            if (rec[i].alpha)
                st = scalar_of(f, rec[i].alpha, &av[i]);
        /* the most common value (the first of equals in key order) is lora_alpha */
        int best = -1, best_n = 0;
        for (int i = 0; st == MDT_OK && i < n; i++) {
            if (!rec[i].alpha)
                continue;
            int cnt = 0;
            for (int j = 0; j < n; j++)
                cnt += rec[j].alpha && av[j] == av[i];
            if (cnt > best_n)
                best = i, best_n = cnt;
        }
        if (st == MDT_OK && best >= 0) {
            c.lora_alpha = av[best], c.alpha_given = 1;
            for (int i = 0; i < n; i++)
                if (rec[i].alpha && av[i] != av[best])
                    cJSON_AddNumberToObject(alphas, rec[i].mod, av[i]);
            c.alpha_p = alphas;
        }
    }
    for (int i = 0; st == MDT_OK && i < n; i++) {
        const double r = (double)t[i].rank;
        double alpha = c.alpha_given ? c.lora_alpha : r, rk = c.r >= 0 ? c.r : r, v;
        int found;
        st = pattern_value(c.alpha_p, rec[i].mod, src, "alpha_pattern", &v, &found);
        if (st == MDT_OK && found)
            alpha = v;
        if (st == MDT_OK && c.meta)
            st = pattern_value(c.rank_p, rec[i].mod, src, "rank_pattern", &rk, &found);
        if (st == MDT_OK && c.meta && rk != r)
            st = MDT_FAIL(MDT_E_INVALID,
                          "%s: module '%s' has rank %lld but the lora_adapter_metadata says %g%s",
                          src, rec[i].mod, (long long)t[i].rank, rk,
                          found || c.r_given ? ""
                                             : " (peft's default r: the metadata gives no r, and "
                                               "diffusers' LoraConfig takes 8)");
        t[i].scale = c.rslora ? alpha / sqrt(r) : alpha / r;
    }
    cJSON_Delete(alphas);
    mdt_free(av);
    return st;
}

static mdt_status parse_meta(const mdt_st_file *f, const char *src, cJSON **out) {
    *out = NULL;
    const char *txt = mdt_st_meta(f, "lora_adapter_metadata");
    if (!txt || !*txt) /* diffusers: json.loads(raw) if raw else None */
        return MDT_OK;
    char shown[MDT_ESC_NAME + 32];
    snprintf(shown, sizeof shown, "%s: lora_adapter_metadata", src);
    mdt_json_stats js;
    MDT_TRY(mdt_json_check(txt, strlen(txt), shown, &js));
    MDT_TRY(mdt_json_build(txt, strlen(txt), shown, "not JSON", 0, " \t\r\n", out));
    const mdt_status st = mdt_json_unique_keys(*out, shown);
    if (st != MDT_OK) {
        cJSON_Delete(*out);
        *out = NULL;
        return st;
    }
    if (cJSON_IsNull(*out)) { /* "null": json.loads gives None, no metadata */
        cJSON_Delete(*out);
        *out = NULL;
        return MDT_OK;
    }
    if (!cJSON_IsObject(*out)) {
        cJSON_Delete(*out);
        *out = NULL;
        return MDT_FAIL(MDT_E_FORMAT, "%s: lora_adapter_metadata is not a JSON object", src);
    }
    return MDT_OK;
}

static int cmp_target(const void *a, const void *b) {
    return ((const mdt_lora_target *)a)->wi - ((const mdt_lora_target *)b)->wi;
}

mdt_status mdt_lora_map(const mdt_wtable *t, const mdt_st_file *f, const char *src,
                        mdt_lora_target **out, int *n_out) {
    *out = NULL, *n_out = 0;
    mdt_status st = MDT_OK;
    for (int i = 0; i < f->n; i++) { /* a kind that is not LoRA: refused before anything else */
        const char *kind = other_kind(f->entries[i].name);
        if (kind) {
            char esc[MDT_ESC_NAME];
            mdt_escape(f->entries[i].name, esc, sizeof esc);
            return MDT_FAIL(MDT_E_UNSUPPORTED,
                            "%s: the adapter is %s (key '%s'): meshdit fuses LoRA factors "
                            "(lora_A/lora_B) only",
                            src, kind, esc);
        }
    }
    name_ix *ix = mdt_alloc(sizeof(name_ix) * (size_t)(t->n ? t->n : 1));
    mod_rec *rec = mdt_alloc(sizeof(mod_rec) * (size_t)(f->n ? f->n : 1));
    mdt_lora_target *tg = NULL;
    cJSON *meta = NULL;
    int nrec = 0, kohya = 0, bfl = 0, tenc = 0;
    name_list unmapped = {{0}, 0, 0}, notlin = {{0}, 0, 0}, half = {{0}, 0, 0};
    if (!ix || !rec)
        MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
    for (int i = 0; i < t->n; i++)
        ix[i].name = t->specs[i].name, ix[i].i = i;
    qsort(ix, (size_t)t->n, sizeof *ix, cmp_name_ix);
    for (int i = 0; i < f->n; i++) {
        const mdt_st_entry *e = &f->entries[i];
        char mod[MDT_NAME_MAX], wname[MDT_NAME_MAX + 8];
        const key_kind k = parse_key(e->name, mod, sizeof mod);
        kohya |= strncmp(e->name, "lora_unet_", 10) == 0 || strncmp(e->name, "lora_te", 7) == 0;
        bfl |= strncmp(e->name, "diffusion_model.", 16) == 0;
        tenc |= strncmp(e->name, "text_encoder", 12) == 0;
        snprintf(wname, sizeof wname, "%s.weight", mod);
        const int wi = k == K_OTHER ? -1 : table_find(ix, t->n, wname);
        if (wi < 0) {
            list_add(&unmapped, e->name);
            continue;
        }
        if (!t->lin[wi]) {
            list_add(&notlin, e->name);
            continue;
        }
        mod_rec *x = rec_of(rec, &nrec, mod);
        x->wi = wi;
        /* one key of each kind a module: lora_A and lora_down, or an alpha under two prefixes,
         * would leave one of them unread */
        const mdt_st_entry **slot = k == K_A      ? &x->a
                                    : k == K_B    ? &x->b
                                    : k == K_BIAS ? &x->bias
                                                  : &x->alpha;
        if (*slot) {
            static const char *const what[] = {"lora_A", "lora_B", "lora_B bias", "alpha"};
            char esc[MDT_ESC_NAME], esc0[MDT_ESC_NAME];
            mdt_escape(e->name, esc, sizeof esc);
            mdt_escape((*slot)->name, esc0, sizeof esc0);
            MDT_CHECK(MDT_FAIL(MDT_E_INVALID,
                               "%s: '%s' gives module '%s' a second %s (the first: '%s')", src, esc,
                               mod, what[k], esc0));
        }
        *slot = e;
        if (k != K_ALPHA && !mdt_dtype_is_float(e->dtype)) {
            char esc[MDT_ESC_NAME];
            mdt_escape(e->name, esc, sizeof esc);
            MDT_CHECK(MDT_FAIL(MDT_E_FORMAT, "%s: '%s' has dtype %s, not a float type", src, esc,
                               mdt_dtype_name(e->dtype)));
        }
    }
    char more[48];
    if (unmapped.n) {
        const char *hint = kohya  ? "; kohya names (lora_unet_*) are converted by the Python "
                                    "drop-in (pipe.load_lora_weights runs diffusers' converter)"
                           : bfl  ? "; BFL/ComfyUI names (diffusion_model.*) are converted by the "
                                    "Python drop-in (pipe.load_lora_weights)"
                           : tenc ? "; meshdit runs the transformer only, not the text encoders"
                                  : "";
        MDT_CHECK(MDT_FAIL(MDT_E_INVALID,
                           "%s: %d key%s map%s to no weight of the model: %s%s (expected "
                           "[transformer.]MODULE.lora_A.weight / lora_B.weight / alpha with "
                           "MODULE.weight in the checkpoint)%s",
                           src, unmapped.n, unmapped.n == 1 ? "" : "s", unmapped.n == 1 ? "s" : "",
                           unmapped.buf, list_more(&unmapped, more, sizeof more), hint));
    }
    if (notlin.n)
        MDT_CHECK(MDT_FAIL(MDT_E_UNSUPPORTED,
                           "%s: %d key%s target%s a weight that is not a linear layer's (a norm, "
                           "an embedding table): %s%s; meshdit fuses LoRA into linear weights only",
                           src, notlin.n, notlin.n == 1 ? "" : "s", notlin.n == 1 ? "s" : "",
                           notlin.buf, list_more(&notlin, more, sizeof more)));
    for (int i = 0; i < nrec; i++)
        for (int b = 0; b < 2; b++)
            if (!(b ? rec[i].b : rec[i].a)) {
                char miss[MDT_NAME_MAX + 32];
                snprintf(miss, sizeof miss, "%s.lora_%s.weight", rec[i].mod, b ? "B" : "A");
                list_add(&half, miss);
            }
    if (half.n)
        MDT_CHECK(MDT_FAIL(MDT_E_INVALID,
                           "%s: %d key%s missing: %s%s (each module needs both "
                           "factors)",
                           src, half.n, half.n == 1 ? " is" : "s are", half.buf,
                           list_more(&half, more, sizeof more)));
    if (nrec == 0)
        MDT_CHECK(MDT_FAIL(MDT_E_INVALID, "%s: the file holds no LoRA factors", src));
    tg = mdt_calloc(sizeof *tg * (size_t)nrec);
    if (!tg)
        MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
    for (int i = 0; i < nrec; i++) {
        const mdt_weight_spec *w = &t->specs[rec[i].wi];
        tg[i].wi = rec[i].wi, tg[i].bi = -1;
        tg[i].ea = rec[i].a, tg[i].eb = rec[i].b, tg[i].ebias = rec[i].bias;
        MDT_CHECK(check_shapes(w, &rec[i], src, &tg[i].rank));
        tg[i].a_shape[0] = tg[i].rank, tg[i].a_shape[1] = w->shape[1];
        tg[i].b_shape[0] = w->shape[0], tg[i].b_shape[1] = tg[i].rank;
        if (rec[i].bias) {
            char bname[MDT_NAME_MAX + 8];
            snprintf(bname, sizeof bname, "%s.bias", rec[i].mod);
            tg[i].bi = table_find(ix, t->n, bname);
            if (tg[i].bi < 0)
                MDT_CHECK(MDT_FAIL(MDT_E_UNSUPPORTED,
                                   "%s: the adapter has a lora_B bias for '%s', whose layer has no "
                                   "bias in this model",
                                   src, rec[i].mod));
        }
    }
    MDT_CHECK(parse_meta(f, src, &meta));
    MDT_CHECK(resolve_scales(f, src, meta, rec, tg, nrec));
    qsort(tg, (size_t)nrec, sizeof *tg, cmp_target); /* the table's order */
    *out = tg, *n_out = nrec;
    tg = NULL;
fail:
    cJSON_Delete(meta);
    mdt_free(tg);
    mdt_free(rec);
    mdt_free(ix);
    return st;
}

mdt_weight_spec mdt_lora_factor_spec(const mdt_weight_spec *w, int64_t rank, char which) {
    mdt_weight_spec s = *w;
    const int dim = mdt_tp_shard_dim(w->style);
    s.ndim = 2, s.stored_ndim = 0;
    s.shape[which == 'A' ? 0 : 1] = rank;
    if (dim != (which == 'A' ? 1 : 0)) /* the factor does not carry the shard dim: whole */
        s.style = MDT_TP_REPLICATED, s.nblocks = 0;
    return s;
}

mdt_status mdt_lora_read(const mdt_wtable *t, const mdt_st_file *f, int T, int k, mdt_lora *l) {
    const int64_t before = mdt_counters_get()->bytes_read;
    mdt_status st = MDT_OK;
    for (int i = 0; st == MDT_OK && i < l->n; i++) {
        mdt_lora_target *x = &l->t[i];
        const mdt_weight_spec *w = &t->specs[x->wi];
        const mdt_weight_spec sa = mdt_lora_factor_spec(w, x->rank, 'A');
        const mdt_weight_spec sb = mdt_lora_factor_spec(w, x->rank, 'B');
        int64_t la[2], lb[2];
        mdt_shard_local_shape(&sa, T, k, la); /* [r, in_local] */
        mdt_shard_local_shape(&sb, T, k, lb); /* [out_local, r] */
        float *a = mdt_alloc(sizeof(float) * (size_t)(la[0] * la[1]));
        x->at = mdt_alloc(sizeof(float) * (size_t)(la[0] * la[1]));
        x->b = mdt_alloc(sizeof(float) * (size_t)(lb[0] * lb[1]));
        if (!a || !x->at || !x->b) {
            mdt_free(a);
            return MDT_FAIL(MDT_E_NOMEM, "out of memory for the factors of '%s'", w->name);
        }
        l->bytes += 4 * (la[0] * la[1] + lb[0] * lb[1]);
        const mdt_ckpt_ref ra = {NULL, f, x->ea};
        const mdt_ckpt_ref rb = {NULL, f, x->eb};
        st = mdt_model_read_shard(&ra, &sa, T, k, a); /* [r, in_local] */
        if (st == MDT_OK)
            st = mdt_model_read_shard(&rb, &sb, T, k, x->b); /* [out_local, r] */
        for (int64_t r = 0; st == MDT_OK && r < la[0]; r++)  /* A^T [in_local, r] */
            for (int64_t c = 0; c < la[1]; c++)
                x->at[c * la[0] + r] = a[r * la[1] + c];
        mdt_free(a);
        if (st == MDT_OK && x->bi >= 0) {
            const mdt_weight_spec *bs = &t->specs[x->bi];
            int64_t lbias[2];
            mdt_shard_local_shape(bs, T, k, lbias);
            x->bias = mdt_alloc(sizeof(float) * (size_t)lbias[0]);
            const mdt_ckpt_ref rbias = {NULL, f, x->ebias};
            st = x->bias ? mdt_model_read_shard(&rbias, bs, T, k, x->bias) /* [out_local] */
                         : MDT_FAIL(MDT_E_NOMEM, "out of memory");
            l->bytes += 4 * lbias[0];
        }
        /* every tensor read, at any scale (a weight of 0 must not hide a NaN for later) */
        const struct {
            const float *v;
            int64_t n;
            const mdt_st_entry *e;
        } got[3] = {{x->at, la[0] * la[1], x->ea},
                    {x->b, lb[0] * lb[1], x->eb},
                    {x->bias, x->bias && x->bi >= 0 ? t->specs[x->bi].shape[0] : 0, x->ebias}};
        for (int j = 0; st == MDT_OK && j < 3; j++) {
            int64_t n = got[j].n;
            if (j == 2 && n > 0) { /* the bias's local length */
                int64_t lbias[2];
                mdt_shard_local_shape(&t->specs[x->bi], T, k, lbias);
                n = lbias[0];
            }
            if (n > 0 && mdt_first_nonfinite(got[j].v, n) >= 0) {
                char esc[MDT_ESC_NAME];
                st = MDT_FAIL(MDT_E_FORMAT,
                              "%s: '%s' (for '%s') holds a value that is NaN, Inf or beyond "
                              "float32's range",
                              l->source, mdt_escape(got[j].e->name, esc, sizeof esc), w->name);
            }
        }
    }
    l->bytes_read += mdt_counters_get()->bytes_read - before;
    return st;
}

void mdt_lora_free(mdt_lora *l) {
    if (!l)
        return;
    for (int i = 0; i < l->n; i++) {
        mdt_free(l->t[i].at);
        mdt_free(l->t[i].b);
        mdt_free(l->t[i].bias);
    }
    mdt_free(l->t);
    mdt_free(l);
}

/* ---- the describe-only view (inspect) ---- */
mdt_status mdt_model_info_lora(const mdt_model_info *info, const char *path, int tp,
                               mdt_lora_target_info **out, int *n) {
    *out = NULL, *n = 0;
    const mdt_wtable *t = &info->m->table;
    mdt_st_file *f = NULL;
    mdt_lora_target *tg = NULL;
    int nt = 0;
    mdt_status st = mdt_st_open(path, &f);
    if (st == MDT_OK)
        st = mdt_lora_map(t, f, f->path, &tg, &nt);
    mdt_lora_target_info *r = st == MDT_OK ? mdt_calloc(sizeof *r * (size_t)(nt ? nt : 1)) : NULL;
    if (st == MDT_OK && !r)
        st = MDT_FAIL(MDT_E_NOMEM, "out of memory");
    for (int i = 0; st == MDT_OK && i < nt; i++) {
        const mdt_weight_spec *w = &t->specs[tg[i].wi];
        const mdt_weight_spec sa = mdt_lora_factor_spec(w, tg[i].rank, 'A');
        const mdt_weight_spec sb = mdt_lora_factor_spec(w, tg[i].rank, 'B');
        st = mdt_shard_local_shape(&sa, tp, 0, r[i].a_local); /* coordinate 0: the largest */
        if (st == MDT_OK)
            st = mdt_shard_local_shape(&sb, tp, 0, r[i].b_local);
        r[i].weight = w->name, r[i].tp_style = mdt_tp_style_name(w->style);
        r[i].rank = tg[i].rank, r[i].scale = tg[i].scale, r[i].has_bias = tg[i].bi >= 0;
        r[i].bytes_local =
            4 * (r[i].a_local[0] * r[i].a_local[1] + r[i].b_local[0] * r[i].b_local[1] +
                 (tg[i].bi >= 0 ? r[i].b_local[0] : 0));
    }
    mdt_free(tg);
    mdt_st_close(f);
    if (st != MDT_OK) {
        mdt_free(r);
        return st;
    }
    *out = r, *n = nt;
    return MDT_OK;
}

void mdt_lora_targets_free(mdt_lora_target_info *t) { mdt_free(t); }
