/*
 * registry.c — the model families this build knows: the only file that names them. Adding a
 * family is one line here plus its own file.
 */
#include "models/family.h"

#include "io/checkpoint.h"

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
    char shown[MDT_ESC_NAME];
    if (!*out)
        return MDT_FAIL(MDT_E_UNSUPPORTED,
                        "config.json: model class '%s' is not supported "
                        "(supported: FluxTransformer2DModel, MiniMaxH3Transformer3DModel, "
                        "Flux2Transformer2DModel, QwenImageTransformer2DModel, "
                        "WanTransformer3DModel)",
                        mdt_escape(cls, shown, sizeof shown));
    return MDT_OK;
}

const char *mdt_family_preset(const mdt_family *f, const char *name) {
    for (const mdt_preset *p = mdt_presets; f && name && p->family; p++)
        if (strcmp(p->family, f->name) == 0 && strcmp(p->name, name) == 0)
            return p->text;
    return NULL;
}
