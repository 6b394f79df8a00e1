/*
 * registry.c — the model families this build knows: the only file that names them. Adding a
 * family is one line here plus its own file.
 */
#include "models/family.h"

#include "io/checkpoint.h"

#include <stdio.h>
#include <string.h>

extern const mdt_family mdt_family_flux;
extern const mdt_family mdt_family_minimax_h3;
extern const mdt_family mdt_family_flux2;
extern const mdt_family mdt_family_qwenimage;
extern const mdt_family mdt_family_wan;
static const mdt_family *const k_families[] = {&mdt_family_flux, &mdt_family_minimax_h3,
                                               &mdt_family_flux2, &mdt_family_qwenimage,
                                               &mdt_family_wan};
enum { N_FAMILIES = sizeof k_families / sizeof k_families[0] };

const mdt_family *mdt_family_by_name(const char *name) {
    for (int i = 0; i < N_FAMILIES; i++)
        if (strcmp(k_families[i]->name, name) == 0 || strcmp(k_families[i]->class_name, name) == 0)
            return k_families[i];
    return NULL;
}

mdt_status mdt_family_from_config(const cJSON *config, const mdt_family **out) {
    const char *cls;
    *out = NULL;
    MDT_TRY(mdt_cfg_string(config, "_class_name", &cls));
    if (!cls)
        return MDT_FAIL(MDT_E_INVALID, "config.json: '_class_name' is missing (which model is "
                                       "this?)");
    *out = mdt_family_by_name(cls);
    char shown[MDT_ESC_NAME], known[512];
    mdt_family_list(known, sizeof known, 1);
    if (!*out)
        return MDT_FAIL(MDT_E_UNSUPPORTED,
                        "config.json: model class '%s' is not supported (supported: %s)",
                        mdt_escape(cls, shown, sizeof shown), known);
    return MDT_OK;
}

void mdt_family_list(char *buf, size_t cap, int class_names) {
    size_t n = 0;
    buf[0] = 0;
    for (int i = 0; i < N_FAMILIES && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%s", i ? ", " : "",
                              class_names ? k_families[i]->class_name : k_families[i]->name);
}

void mdt_preset_list(char *buf, size_t cap) {
    size_t n = 0;
    buf[0] = 0;
    for (int i = 0; i < N_FAMILIES; i++) {
        const char *sep = n ? "; " : "";
        for (const mdt_preset *p = mdt_presets; p->family && n < cap; p++)
            if (strcmp(p->family, k_families[i]->name) == 0) {
                n += (size_t)snprintf(buf + n, cap - n, "%s%s%s%s", sep,
                                      *sep != ',' ? k_families[i]->name : "",
                                      *sep != ',' ? ": " : "", p->name);
                sep = ", ";
            }
    }
}

const char *mdt_family_preset(const mdt_family *f, const char *name) {
    for (const mdt_preset *p = mdt_presets; f && name && p->family; p++)
        if (strcmp(p->family, f->name) == 0 && strcmp(p->name, name) == 0)
            return p->text;
    return NULL;
}
