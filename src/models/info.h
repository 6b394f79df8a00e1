/*
 * info.h — the describe-only model view behind mdt_model_info (meshdit.h), shared by the API
 * files that read a model's config and weight table without its weights.
 */
#ifndef MDT_MODELS_INFO_H
#define MDT_MODELS_INFO_H

#include "io/checkpoint.h"
#include "models/model.h"

struct mdt_model_info {
    mdt_model *m; /* described: config and weight table, no weights */
    mdt_ckpt *ck; /* the checkpoint's index when opened with it, else NULL */
    cJSON *cfg;   /* the config when read from a file, else NULL (the index owns it) */
};

#endif /* MDT_MODELS_INFO_H */
