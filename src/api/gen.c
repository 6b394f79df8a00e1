/*
 * gen.c — random-weight checkpoints for a client (meshdit.h): the families and their presets,
 * and mdt_checkpoint_gen over a preset or a config file.
 */
#include "core/core.h"
#include "io/checkpoint.h"
#include "models/model.h"

#include <cjson/cJSON.h>

int mdt_family_exists(const char *family) { return mdt_family_by_name(family) != NULL; }

int mdt_family_has_preset(const char *family, const char *preset) {
    const mdt_family *fam = mdt_family_by_name(family);
    return mdt_family_preset(fam, preset) != NULL;
}

void mdt_family_names(char *buf, size_t cap) { mdt_family_list(buf, cap, 0); }

void mdt_preset_names(char *buf, size_t cap) { mdt_preset_list(buf, cap); }

mdt_status mdt_checkpoint_gen(const char *family, const char *preset, const char *config_path,
                              uint64_t seed, mdt_dtype dtype, int shards, const char *dir) {
    if (!preset == !config_path)
        return MDT_FAIL(MDT_E_INVALID, "give exactly one of a preset or a config file");
    if (preset) {
        const mdt_family *fam = mdt_family_by_name(family);
        const char *text = mdt_family_preset(fam, preset);
        if (!text)
            return MDT_FAIL(MDT_E_NOTFOUND, "unknown preset '%s' of model '%s'", preset, family);
        return mdt_model_gen(text, seed, dtype, shards, dir);
    }
    cJSON *j;
    MDT_TRY(mdt_config_load(config_path, &j));
    const mdt_family *named = family ? mdt_family_by_name(family) : NULL, *of = NULL;
    mdt_status st =
        family && !named ? MDT_FAIL(MDT_E_INVALID, "unknown model '%s'", family) : MDT_OK;
    if (st == MDT_OK && named && (st = mdt_family_from_config(j, &of)) != MDT_OK)
        st = mdt_config_error_at(st, config_path); /* the message names the file given */
    else if (st == MDT_OK && named && of != named)
        st = MDT_FAIL(MDT_E_INVALID, "model '%s' given, but %s is a %s config (its _class_name)",
                      family, config_path, of->class_name);
    if (st != MDT_OK) {
        cJSON_Delete(j);
        return st;
    }
    char *text = cJSON_Print(j);
    cJSON_Delete(j);
    if (!text)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    st = mdt_config_error_at(mdt_model_gen(text, seed, dtype, shards, dir), config_path);
    cJSON_free(text);
    return st;
}
