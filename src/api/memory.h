/*
 * memory.h — the memory check of one forward of a loaded model (memory.c), for the server: the
 * same estimate as mdt_check_memory (meshdit.h) without re-reading the checkpoint.
 */
#ifndef MDT_API_MEMORY_H
#define MDT_API_MEMORY_H

#include "models/model.h"

/* This rank's weights plus the activations of a forward of `inputs` against `limit` bytes
 * (MDT_E_NOMEM naming the need and the limit; MDT_OK when limit <= 0). Local: the caller agrees
 * on the verdict. */
mdt_status mdt_check_forward_memory(const mdt_model *m, const mdt_tensor_set *inputs, int64_t limit,
                                    int device_activations);

#endif /* MDT_API_MEMORY_H */
