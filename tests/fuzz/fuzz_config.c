/* fuzz_config.c — libFuzzer target: the input is a config.json. Parsing, family selection and the
 * weight table construction must accept it or fail with a status (sizes are bounded by the
 * accessors' checks; huge sizes must not allocate the table's tensors). */
#include "models/model.h"

#include <cjson/cJSON.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    cJSON *cfg = cJSON_ParseWithLength((const char *)data, size);
    if (!cfg)
        return 0;
    mdt_model *m = NULL;
    if (cJSON_IsObject(cfg) && mdt_model_describe(cfg, &m) == MDT_OK) {
        for (int T = 1; T <= 8; T++)
            (void)mdt_model_check_layout(m, T, 1, 1);
        mdt_model_free(m);
    }
    cJSON_Delete(cfg);
    return 0;
}
