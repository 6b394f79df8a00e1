#!/usr/bin/env bash
# test_cli.sh — the meshdit command end to end: every diffusers golden case, the sampler, gen and
# inputs, and every error class a user can hit from the command line (exit status, one message
# line naming the file/tensor/problem, and no output file left behind).
set -u
BIN=${BIN:-build/meshdit}
DATA=${DATA:-tests/data}
ST_EDIT=${ST_EDIT:-tests/cli/st-edit} # rewrites a safetensors file's tensors (tests/cli/st-edit)
T=$(mktemp -d /tmp/mdt_cli_XXXXXX)
trap 'rm -rf "$T"' EXIT
pass=0 fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*" >&2; }

# expect_error NAME RC PATTERN... -- CMD...: exit status RC, exactly one stderr line matching
# every PATTERN, and no $T/out.safetensors afterwards.
expect_error() {
    local name=$1 want=$2; shift 2
    local pats=()
    while [ "$1" != "--" ]; do pats+=("$1"); shift; done
    shift
    rm -f "$T/out.safetensors"
    "$@" >"$T/stdout" 2>"$T/stderr"
    local rc=$?
    local lines; lines=$(grep -c . "$T/stderr")
    [ "$rc" = "$want" ] || { bad "$name: exit $rc, wanted $want ($(head -c 300 "$T/stderr"))"; return; }
    [ "$want" = 2 ] || [ "$lines" = 1 ] || { bad "$name: $lines stderr lines: $(cat "$T/stderr")"; return; }
    for p in "${pats[@]}"; do
        grep -q -- "$p" "$T/stderr" || { bad "$name: message lacks '$p': $(cat "$T/stderr")"; return; }
    done
    [ ! -e "$T/out.safetensors" ] || { bad "$name: left an output file"; return; }
    ls -A "$T" | grep -q '\.tmp\.\|^\.mdt-' && { bad "$name: left a temporary file"; return; }
    ok
}

run_case() { # case-dir expected-file [extra run args]
    local dir=$1 exp=$2; shift 2
    if "$BIN" run --checkpoint "$dir" --inputs "$dir/inputs.safetensors" --out "$T/o.safetensors" \
        --quiet "$@" && "$BIN" compare "$T/o.safetensors" "$exp" --tol 1e-4 >"$T/cmp"; then
        ok
    else
        bad "golden $(basename "$dir") $(basename "$exp"): $(cat "$T/cmp" 2>/dev/null)"
    fi
}

# ---- goldens from diffusers ----
for d in "$DATA"/*/; do
    d=${d%/}
    [ -f "$d/expected.safetensors" ] || continue
    run_case "$d" "$d/expected.safetensors"
done
run_case "$DATA/flux_tiny" "$DATA/flux_tiny/expected_steps2.safetensors" --steps 2
# an edit's condition images (the rows after img_shapes' first image) are not stepped: the golden
# keeps them as given, as Qwen-Image-Edit's pipelines do (stepping them moves them by ~0.4)
run_case "$DATA/qwenimage_edit2511" "$DATA/qwenimage_edit2511/expected_steps2.safetensors" --steps 2
# negative control: the 2-step result is not the 1-forward result
if "$BIN" compare "$DATA/flux_tiny/expected.safetensors" "$DATA/flux_tiny/expected_steps2.safetensors" >/dev/null; then
    bad "compare accepted different tensors"
else ok; fi
# negative control of Qwen-Image-Edit-2511's zero_cond_t: the same weights with it false miss the
# golden (the condition images' rows modulated at timestep t, not 0)
cp -r "$DATA/qwenimage_edit2511" "$T/zc" && sed -i 's/"zero_cond_t": true/"zero_cond_t": false/' "$T/zc/config.json"
if grep -q '"zero_cond_t": false' "$T/zc/config.json" &&
   "$BIN" run --checkpoint "$T/zc" --inputs "$T/zc/inputs.safetensors" --out "$T/zc.safetensors" --quiet &&
   ! "$BIN" compare "$T/zc.safetensors" "$T/zc/expected.safetensors" --tol 1e-3 >/dev/null; then ok
else bad "zero_cond_t made no difference"; fi
# Qwen-Image-Layered: every latent layer stepped, the input image (img_shapes' last) kept
run_case "$DATA/qwenimage_layered" "$DATA/qwenimage_layered/expected_steps2.safetensors" --steps 2
# negative controls: the same weights without use_layer3d_rope (the input image at frame 3, the
# text from 2), and additional_t_cond [1, 1] for [1, 0], miss the golden
QL=$DATA/qwenimage_layered
cp -r "$QL" "$T/ql" && sed -i 's/"use_layer3d_rope": true/"use_layer3d_rope": false/' "$T/ql/config.json"
if grep -q '"use_layer3d_rope": false' "$T/ql/config.json" &&
   "$BIN" run --checkpoint "$T/ql" --inputs "$QL/inputs.safetensors" --out "$T/ql.safetensors" --quiet &&
   ! "$BIN" compare "$T/ql.safetensors" "$QL/expected.safetensors" --tol 1e-3 >/dev/null; then ok
else bad "use_layer3d_rope made no difference"; fi
"$ST_EDIT" "$QL/inputs.safetensors" "$T/ql_rep.st" additional_t_cond@repeat
if "$BIN" run --checkpoint "$QL" --inputs "$T/ql_rep.st" --out "$T/ql_rep.safetensors" --quiet &&
   ! "$BIN" compare "$T/ql_rep.safetensors" "$QL/expected.safetensors" --tol 1e-3 >/dev/null; then ok
else bad "additional_t_cond made no difference"; fi

# ---- the sampler's inputs as diffusers pipelines pass them ----
# `--steps` takes a latent in any float dtype (converted to f32 once: the result is the f32 run on
# the same values) and a timestep in any number dtype (the sampler writes it each step): bf16
# latents, and wan_tiny's int64 timestep (as diffusers' tester draws it)
same_run() { # same_run NAME CKPT INPUTS_A INPUTS_B [run args]: both runs succeed, identical bytes
    local name=$1 ck=$2 a=$3 b=$4; shift 4
    if "$BIN" run --checkpoint "$ck" --inputs "$a" --out "$T/sa.safetensors" --quiet "$@" 2>"$T/sa.err" &&
       "$BIN" run --checkpoint "$ck" --inputs "$b" --out "$T/sb.safetensors" --quiet "$@" 2>"$T/sb.err" &&
       cmp -s "$T/sa.safetensors" "$T/sb.safetensors"; then ok
    else bad "$name: $(cat "$T/sa.err" "$T/sb.err" 2>/dev/null | head -2)"; fi
}
"$ST_EDIT" "$DATA/flux_tiny/inputs.safetensors" "$T/lat_bf16.st" hidden_states=BF16
"$ST_EDIT" "$T/lat_bf16.st" "$T/lat_f32.st" hidden_states=F32
same_run "--steps with a BF16 latent" "$DATA/flux_tiny" "$T/lat_bf16.st" "$T/lat_f32.st" --steps 2
"$ST_EDIT" "$DATA/wan_tiny/inputs.safetensors" "$T/wan_tf32.st" timestep=F32
same_run "--steps with an I64 timestep" "$DATA/wan_tiny" "$DATA/wan_tiny/inputs.safetensors" \
    "$T/wan_tf32.st" --steps 2
"$ST_EDIT" "$DATA/flux_tiny/inputs.safetensors" "$T/both.st" hidden_states=BF16 timestep=I64
# img_shapes in any integer dtype the forward reads: the edit's condition rows kept alike
"$ST_EDIT" "$DATA/qwenimage_edit2511/inputs.safetensors" "$T/qe_i16.st" img_shapes=I16
same_run "--steps with I16 img_shapes" "$DATA/qwenimage_edit2511" "$T/qe_i16.st" \
    "$DATA/qwenimage_edit2511/inputs.safetensors" --steps 2
same_run "--steps with a BF16 latent and an I64 timestep" "$DATA/flux_tiny" "$T/both.st" \
    "$T/lat_f32.st" --steps 2
# a one-element timestep (and guidance) with batch 2 is every sample's, as diffusers' forwards
# broadcast it (Flux, Flux.2, Qwen-Image, Wan; Wan's per-token [1, S] likewise): the same bytes as
# the value repeated over the batch, one forward and under the sampler
for c in "flux_guidance timestep guidance" "flux2_guidance timestep guidance" \
         "qwenimage_bf16_sharded timestep" "qwenimage_layered additional_t_cond" \
         "qwenimage_controlnet controlnet_block_samples" \
         "flux_controlnet controlnet_block_samples controlnet_single_block_samples" \
         "wan_odd timestep" "wan_ti2v timestep"; do
    set -- $c
    d=$1; shift
    first=() rep=()
    for n in "$@"; do first+=("$n@first"); rep+=("$n@repeat"); done
    "$ST_EDIT" "$DATA/$d/inputs.safetensors" "$T/one.st" "${first[@]}"
    "$ST_EDIT" "$DATA/$d/inputs.safetensors" "$T/rep.st" "${rep[@]}"
    same_run "$d: a [1] $* with batch 2" "$DATA/$d" "$T/one.st" "$T/rep.st"
done
"$ST_EDIT" "$DATA/flux_guidance/inputs.safetensors" "$T/one.st" timestep@first guidance@first
"$ST_EDIT" "$DATA/flux_guidance/inputs.safetensors" "$T/rep.st" timestep@repeat guidance@repeat
same_run "--steps with a [1] timestep and guidance, batch 2" "$DATA/flux_guidance" "$T/one.st" \
    "$T/rep.st" --steps 2
# negative control: a [1] timestep is not any [2] one
"$ST_EDIT" "$DATA/flux_guidance/inputs.safetensors" "$T/one.st" timestep@first
if "$BIN" run --checkpoint "$DATA/flux_guidance" --inputs "$T/one.st" --out "$T/sa.safetensors" --quiet &&
   ! "$BIN" compare "$T/sa.safetensors" "$DATA/flux_guidance/expected.safetensors" >/dev/null; then ok
else bad "a [1] timestep matched the golden's two distinct timesteps"; fi
# a 0-d additional_t_cond is every element's, as diffusers broadcasts it: the same bytes as [1],
# on one rank and where the cfg axis splits the batch between its halves
"$ST_EDIT" "$QL/inputs.safetensors" "$T/ql_0d.st" additional_t_cond@scalar
"$ST_EDIT" "$QL/inputs.safetensors" "$T/ql_1.st" additional_t_cond@first
same_run "qwenimage_layered: a 0-d additional_t_cond" "$QL" "$T/ql_0d.st" "$T/ql_1.st"
if "$MPIEXEC" -n 2 "$BIN" run --checkpoint "$QL" --inputs "$T/ql_0d.st" --out "$T/c0.st" --quiet --cfg 2 &&
   "$MPIEXEC" -n 2 "$BIN" run --checkpoint "$QL" --inputs "$T/ql_1.st" --out "$T/c1.st" --quiet --cfg 2 &&
   cmp -s "$T/c0.st" "$T/c1.st"; then ok
else bad "a 0-d additional_t_cond under --cfg 2"; fi
# a per-sample input of another length is refused, naming both shapes it may have
"$ST_EDIT" "$DATA/flux_guidance/inputs.safetensors" "$T/three.st" guidance@grow
expect_error timestep-batch 1 "tensor 'guidance' has shape \\[3\\], expected \\[2\\] or \\[1\\]" -- \
    "$BIN" run --checkpoint "$DATA/flux_guidance" --inputs "$T/three.st" --out "$T/out.safetensors"
# ControlNet residuals ([B, N, S_img, C] per stack): the goldens above equal diffusers; negative
# controls: without the single-block residuals, without XLabs' repeat flag (blocks read 0, 1, 0 of
# the 2 residuals, not 0, 0, 1), and with element 1 given element 0's residuals (Qwen-Image runs
# the two elements, whose masks differ, in a pass each) each miss the golden
FC=$DATA/flux_controlnet FR=$DATA/flux_controlnet_repeat QC=$DATA/qwenimage_controlnet
misses() { # misses NAME CKPT INPUTS: the run succeeds and misses the checkpoint's golden
    if "$BIN" run --checkpoint "$2" --inputs "$3" --out "$T/miss.safetensors" --quiet &&
       ! "$BIN" compare "$T/miss.safetensors" "$2/expected.safetensors" --tol 1e-3 >/dev/null; then ok
    else bad "$1 made no difference"; fi
}
"$ST_EDIT" "$FC/inputs.safetensors" "$T/fc_nosingle.st" controlnet_single_block_samples@drop
misses "controlnet_single_block_samples" "$FC" "$T/fc_nosingle.st"
"$ST_EDIT" "$FR/inputs.safetensors" "$T/fr_norepeat.st" controlnet_blocks_repeat@drop
misses "controlnet_blocks_repeat" "$FR" "$T/fr_norepeat.st"
"$ST_EDIT" "$QC/inputs.safetensors" "$T/qc_rep.st" controlnet_block_samples@repeat
misses "a Qwen pass's own residuals" "$QC" "$T/qc_rep.st"
"$ST_EDIT" "$FR/inputs.safetensors" "$T/fr_flag.st" controlnet_block_samples@drop
expect_error controlnet-repeat-alone 1 "'controlnet_blocks_repeat' is set but there is no" -- \
    "$BIN" run --checkpoint "$FR" --inputs "$T/fr_flag.st" --out "$T/out.safetensors"
"$ST_EDIT" "$FC/inputs.safetensors" "$T/fc_batch.st" controlnet_block_samples@grow
expect_error controlnet-batch 1 "tensor 'controlnet_block_samples' has shape \\[3, 2, 23, 32\\], expected \\[2, 2, 23, 32\\]" -- \
    "$BIN" run --checkpoint "$FC" --inputs "$T/fc_batch.st" --out "$T/out.safetensors"
expect_error controlnet-cache 1 "a step cache with ControlNet residuals is not supported" -- \
    "$BIN" run --checkpoint "$QC" --inputs "$QC/inputs.safetensors" --out "$T/out.safetensors" \
    --steps 2 --cache first_block:threshold=0.05
# Qwen-Image-Layered's inputs: additional_t_cond is required, an embedding row (0 or 1), and
# only for a config with use_additional_t_cond; the input image (the last) is one frame
"$ST_EDIT" "$QL/inputs.safetensors" "$T/ql_none.st" additional_t_cond@drop
expect_error layered-no-t-cond 1 "tensor 'additional_t_cond' is missing" -- \
    "$BIN" run --checkpoint "$QL" --inputs "$T/ql_none.st" --out "$T/out.safetensors"
"$ST_EDIT" "$QL/inputs.safetensors" "$T/ql_two.st" additional_t_cond@inc
expect_error layered-t-cond-range 1 "'additional_t_cond' element 0 is 2, outside \\[0, 2)" -- \
    "$BIN" run --checkpoint "$QL" --inputs "$T/ql_two.st" --out "$T/out.safetensors"
"$ST_EDIT" "$QL/inputs.safetensors" "$T/ql_frames.st" img_shapes@inc
expect_error layered-frames 1 "'img_shapes' image 3" "use_layer3d_rope" "has 2 frames" -- \
    "$BIN" run --checkpoint "$QL" --inputs "$T/ql_frames.st" --out "$T/out.safetensors"
# `meshdit inputs` draws a Layered checkpoint's inputs as its pipeline passes them (a layer, the
# input image, additional_t_cond 0), so gen -> inputs -> run works, guided too
if "$BIN" gen --model qwenimage --config "$QL/config.json" --out "$T/qlg" >/dev/null &&
   "$BIN" inputs --checkpoint "$T/qlg" --out "$T/qlg.st" --negative --batch 2 >/dev/null &&
   "$BIN" run --checkpoint "$T/qlg" --inputs "$T/qlg.st" --out "$T/qlg_out.st" --quiet \
       --steps 2 --guidance-scale 3; then ok
else bad "gen, inputs and run of a Qwen-Image-Layered checkpoint"; fi
# with zero_cond_t too, diffusers adds additional_t_cond to the 2B rows of the t and 0 embeddings:
# one value per element (B = 2) fails there, so it is refused here; one for the batch runs
sed 's/"zero_cond_t": false/"zero_cond_t": true/' "$QL/config.json" >"$T/qlz.json"
"$BIN" gen --model qwenimage --config "$T/qlz.json" --out "$T/qlz" >/dev/null
"$BIN" inputs --checkpoint "$T/qlz" --out "$T/qlz.st" --batch 2 >/dev/null
expect_error layered-zero-cond-t 1 "'additional_t_cond' holds 2 values" "zero_cond_t" -- \
    "$BIN" run --checkpoint "$T/qlz" --inputs "$T/qlz.st" --out "$T/out.safetensors"
"$ST_EDIT" "$T/qlz.st" "$T/qlz1.st" additional_t_cond@first
if "$BIN" run --checkpoint "$T/qlz" --inputs "$T/qlz1.st" --out "$T/qlz_out.st" --quiet; then ok
else bad "zero_cond_t with one additional_t_cond for the batch"; fi
expect_error layered-t-cond-unused 1 "unknown tensor 'additional_t_cond'" -- \
    "$BIN" run --checkpoint "$DATA/qwenimage_edit2511" --inputs "$QL/inputs.safetensors" \
    --out "$T/out.safetensors"
"$ST_EDIT" "$DATA/flux_tiny/inputs.safetensors" "$T/int_latent.st" hidden_states=I64
expect_error steps-integer-latent 1 "--steps" "'hidden_states'" "float" -- "$BIN" run --checkpoint \
    "$DATA/flux_tiny" --inputs "$T/int_latent.st" --out "$T/out.safetensors" --steps 2

# ---- gen / inputs / run / inspect on the built-in tiny model ----
if "$BIN" gen --model flux --preset tiny --seed 1 --out "$T/tiny" >/dev/null &&
   "$BIN" gen --model flux --preset tiny --seed 1 --dtype bf16 --shards 2 --out "$T/tiny_bf16" >/dev/null &&
   "$BIN" inputs --checkpoint "$T/tiny" --seed 2 --img-tokens 9 --txt-tokens 5 --batch 2 --out "$T/in.safetensors" >/dev/null &&
   "$BIN" run --checkpoint "$T/tiny" --inputs "$T/in.safetensors" --out "$T/a.safetensors" --report "$T/r.json" >"$T/run.txt" &&
   "$BIN" run --checkpoint "$T/tiny_bf16" --inputs "$T/in.safetensors" --out "$T/b.safetensors" --quiet &&
   "$BIN" compare "$T/b.safetensors" "$T/a.safetensors" --tol 5e-2 >/dev/null &&
   grep -q '"weight_bytes"' "$T/r.json" && grep -q 'per forward' "$T/run.txt" &&
   [ -f "$T/tiny_bf16/diffusion_pytorch_model.safetensors.index.json" ]; then ok
else bad "gen/inputs/run/report pipeline"; fi
# gen makes the whole checkpoint before it writes: one too large for this process's memory is
# refused up front, an existing checkpoint keeps its files (config.json was written first) and a
# directory it would have created is not left behind
cp "$T/tiny/config.json" "$T/tiny_config_before.json"
expect_error gen-too-large 1 "gen: the checkpoint's 62 tensors take" "nothing written" -- \
    env MESHDIT_MEM_AVAILABLE=64K "$BIN" gen --model flux --preset tiny --seed 5 --out "$T/tiny"
cmp -s "$T/tiny/config.json" "$T/tiny_config_before.json" && ok || bad "a refused gen changed the checkpoint's config.json"
expect_error gen-mem-env 1 "MESHDIT_MEM_AVAILABLE='abc' is not a size" -- \
    env MESHDIT_MEM_AVAILABLE=abc "$BIN" gen --model flux --preset tiny --out "$T/gen_new"
expect_error inputs-audio-zero 2 "--audio-tokens must be an integer in" -- \
    "$BIN" inputs --checkpoint "$DATA/h3_tiny" --audio-tokens 0 --out "$T/out.safetensors"
expect_error gen-too-large-new 1 "nothing written" -- \
    env MESHDIT_MEM_AVAILABLE=64K "$BIN" gen --model flux --preset tiny --out "$T/gen_new"
[ ! -e "$T/gen_new" ] && ok || bad "a refused gen left its new directory"
printf '{"_class_name": 7}' >"$T/cls.json"
expect_error gen-config-named 1 "$T/cls.json: '_class_name' must be a string" -- \
    "$BIN" gen --model flux --config "$T/cls.json" --out "$T/gen_new"
if "$BIN" inspect --checkpoint "$DATA/flux_tiny" --tp 2 >"$T/insp" &&
   grep -q 'single_transformer_blocks.0.proj_out.weight.*packed-rowwise.*\[32, 80\]' "$T/insp"; then ok
else bad "inspect shows packed proj_out shard"; fi
# an FFN width tp does not divide splits unevenly (the first n mod tp ranks one row more): Wan
# 2.1 14B's 13 824 at tp=5 (40 heads) is 2765 | 2764, shown per tensor and per rank
if "$BIN" inspect --config configs/wan2.1_t2v_14b.json --tp 5 >"$T/wan5" &&
   grep -q '^blocks.39.ffn.net.0.proj.weight .*colwise .*\[2765|2764, 5120\]' "$T/wan5" &&
   grep -q '^blocks.39.ffn.net.2.weight .*rowwise .*\[5120, 2765|2764\]' "$T/wan5" &&
   grep -q '^blocks.39.ffn.net.0.proj.bias .*\[2765|2764\]' "$T/wan5" &&
   grep -q '^  tp=5 .*per rank at most, uneven split.*<- this layout' "$T/wan5" &&
   grep -q '^  tp=10 ' "$T/wan5" &&
   [ "$(grep -c '^rank [0-4]: tp [0-4],.*resident$' "$T/wan5")" = 5 ]; then ok
else bad "inspect Wan 14B at tp=5: $(grep -E 'ffn.net.0.proj.weight|tp=5' "$T/wan5" | head -3)"; fi
# and runs: tp=3 splits wan_ffn41's FFN 14 | 14 | 13 (the MPI tests cover tp 2 and 4), equal to
# diffusers; a width no flag lets split unevenly still says which tensor and size
if timeout 300 "$MPIEXEC" -n 3 "$BIN" run --checkpoint "$DATA/wan_ffn41" --inputs \
        "$DATA/wan_ffn41/inputs.safetensors" --out "$T/w3.safetensors" --tp 3 --quiet &&
   "$BIN" compare "$T/w3.safetensors" "$DATA/wan_ffn41/expected.safetensors" --tol 1e-4 >/dev/null; then ok
else bad "wan_ffn41 at tp=3"; fi
# the text embedder's input features split unevenly too: flux2_heads3's joint_attention_dim 20 at
# tp=3 is 7 | 7 | 6 columns of context_embedder (replicated-input rowwise), equal to diffusers; a
# width no flag lets split unevenly (the heads) still says which width and size
if "$BIN" inspect --checkpoint "$DATA/flux2_heads3" --tp 3 >"$T/f2h3" &&
   grep -q '^context_embedder.weight .*replicated-input-rowwise .*\[24, 7|6\]' "$T/f2h3" &&
   timeout 300 "$MPIEXEC" -n 3 "$BIN" run --checkpoint "$DATA/flux2_heads3" --inputs \
        "$DATA/flux2_heads3/inputs.safetensors" --out "$T/f3.safetensors" --tp 3 --quiet &&
   "$BIN" compare "$T/f3.safetensors" "$DATA/flux2_heads3/expected.safetensors" --tol 1e-4 >/dev/null; then ok
else bad "flux2_heads3 at tp=3 (context_embedder 7 | 7 | 6)"; fi
expect_error inspect-heads-not-divided 1 "tp=2 does not divide" "3 attention heads" -- \
    "$BIN" inspect --checkpoint "$DATA/flux2_heads3" --tp 2

# ---- errors from the command line ----
cp -r "$DATA/flux_tiny" "$T/trunc"
truncate -s -100 "$T/trunc/diffusion_pytorch_model.safetensors"
expect_error truncated 1 "diffusion_pytorch_model.safetensors" "truncated" -- \
    "$BIN" run --checkpoint "$T/trunc" --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/out.safetensors"
cp -r "$DATA/flux_tiny" "$T/hlen"
printf '\xff\xff\xff\x00\x00\x00\x00\x00' | dd of="$T/hlen/diffusion_pytorch_model.safetensors" conv=notrunc status=none
expect_error header-length 1 "diffusion_pytorch_model.safetensors" "header length" -- \
    "$BIN" run --checkpoint "$T/hlen" --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/out.safetensors"
cp -r "$DATA/flux_bf16_sharded" "$T/noshard"
rm "$T/noshard/diffusion_pytorch_model-00002-of-00002.safetensors"
expect_error missing-shard 1 "diffusion_pytorch_model-00002-of-00002.safetensors" "missing" -- \
    "$BIN" run --checkpoint "$T/noshard" --inputs "$DATA/flux_bf16_sharded/inputs.safetensors" --out "$T/out.safetensors"
cp -r "$DATA/flux_tiny" "$T/lies"
sed -i 's/"guidance_embeds": false/"guidance_embeds": true/' "$T/lies/config.json"
expect_error missing-tensor 1 "guidance_embedder.linear_1.weight" "missing from the checkpoint" -- \
    "$BIN" run --checkpoint "$T/lies" --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/out.safetensors"
cp -r "$DATA/flux_tiny" "$T/shape"
sed -i 's/"pooled_projection_dim": 32/"pooled_projection_dim": 16/' "$T/shape/config.json"
expect_error shape-mismatch 1 "text_embedder.linear_1.weight" "config.json implies" -- \
    "$BIN" run --checkpoint "$T/shape" --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/out.safetensors"
expect_error wrong-inputs 1 "unknown tensor 'guidance'" "FluxTransformer2DModel takes" -- \
    "$BIN" run --checkpoint "$DATA/flux_tiny" --inputs "$DATA/flux_guidance/inputs.safetensors" --out "$T/out.safetensors"
expect_error no-checkpoint 1 "config.json" -- \
    "$BIN" run --checkpoint "$T/nowhere" --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/out.safetensors"
expect_error layout-vs-world 1 "needs 2 ranks" -- \
    "$BIN" run --checkpoint "$DATA/flux_tiny" --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/out.safetensors" --tp 2
expect_error inspect-tp3 1 "tp=3 does not divide" -- "$BIN" inspect --checkpoint "$DATA/flux_tiny" --tp 3
expect_error unknown-command 2 "unknown command" -- "$BIN" frobnicate
expect_error unknown-option 2 "unknown option --bogus" -- "$BIN" run --checkpoint x --inputs y --out "$T/out.safetensors" --bogus 1
expect_error bad-number 2 "--steps" -- "$BIN" run --checkpoint x --inputs y --out "$T/out.safetensors" --steps -3

# ---- multi-rank from the command line ----
MPIEXEC=${MPIEXEC:-$(command -v mpiexec.mpich || command -v mpiexec)}
for n in 2 4; do
    if timeout 300 "$MPIEXEC" -n $n "$BIN" run --checkpoint "$DATA/flux_guidance" \
            --inputs "$DATA/flux_guidance/inputs.safetensors" --out "$T/tp$n.safetensors" --tp $n \
            --report "$T/tp$n.json" >"$T/tp$n.txt" 2>&1 &&
       "$BIN" compare "$T/tp$n.safetensors" "$DATA/flux_guidance/expected.safetensors" --tol 1e-4 >/dev/null &&
       grep -q '"allreduce"' "$T/tp$n.json" && grep -q "rank $((n - 1)) (tp $((n - 1))" "$T/tp$n.txt"; then ok
    else bad "mpiexec -n $n run --tp $n: $(tail -3 "$T/tp$n.txt")"; fi
    # placement: every rank on this one host, node-local ranks 0 .. n-1 in world order
    nodes=$(tr -d ' \n\t' <"$T/tp$n.json" | grep -o '"node":{[^}]*}')
    want=$(for ((k = 0; k < n; k++)); do printf '"node":{"host":"%s","rank":%d,"ranks":%d}\n' "$(hostname)" $k $n; done)
    [ "$nodes" = "$want" ] && ok || bad "report placement for -n $n: $(echo $nodes)"
done
# rank 0 holds the whole checkpoint to write it: one that does not fit its budget is refused by
# every rank before anything is gathered or written
expect_error gather-too-large 1 "gather: the whole checkpoint takes" "nothing written" -- env MESHDIT_MEM_AVAILABLE=100K \
    timeout 120 "$MPIEXEC" -n 2 "$BIN" gather --checkpoint "$DATA/flux_bf16_sharded" --out "$T/gath_small"
[ ! -e "$T/gath_small" ] && ok || bad "a refused gather left its directory"
# a one-process command under mpiexec runs once (rank 0), not once per rank on the same files
if timeout 60 "$MPIEXEC" -n 2 "$BIN" gen --model flux --preset tiny --out "$T/gen2" >"$T/gen2.txt" &&
   [ "$(grep -c '^wrote' "$T/gen2.txt")" = 1 ]; then ok; else bad "gen under mpiexec -n 2: $(cat "$T/gen2.txt")"; fi
if timeout 300 "$MPIEXEC" -n 2 "$BIN" gather --checkpoint "$DATA/flux_bf16_sharded" --out "$T/gathered" >/dev/null &&
   "$BIN" run --checkpoint "$T/gathered" --inputs "$DATA/flux_bf16_sharded/inputs.safetensors" --out "$T/g.safetensors" --quiet &&
   "$BIN" compare "$T/g.safetensors" "$DATA/flux_bf16_sharded/expected.safetensors" >/dev/null; then ok
else bad "gather tp=2 shards back to a full checkpoint"; fi

# Ulysses 4 over 2 heads and 3 + 2 tokens: rank 3 holds no token and no head, moves nothing in
# the all-to-alls, and that is not a silent degrade; the result equals the single rank
"$BIN" inputs --checkpoint "$DATA/flux_tiny" --img-tokens 3 --txt-tokens 2 --out "$T/few.safetensors" >/dev/null
if "$BIN" run --checkpoint "$DATA/flux_tiny" --inputs "$T/few.safetensors" --out "$T/few1.safetensors" --quiet &&
   timeout 300 "$MPIEXEC" -n 4 "$BIN" run --checkpoint "$DATA/flux_tiny" --inputs "$T/few.safetensors" \
       --out "$T/few4.safetensors" --ulysses 4 --quiet >"$T/few.txt" 2>&1 &&
   "$BIN" compare "$T/few4.safetensors" "$T/few1.safetensors" --tol 1e-5 >/dev/null; then ok
else bad "ulysses 4 with an empty rank: $(tail -2 "$T/few.txt")"; fi

# mpi_error NAME N PATTERN -- ARGS...: under mpiexec -n N every rank exits non-zero, and exactly
# one error line (rank 0's) names the problem
mpi_error() {
    local name=$1 n=$2 pat=$3; shift 4
    rm -f "$T"/rc.*
    timeout 300 "$MPIEXEC" -n "$n" bash -c '"$@"; echo $? > "'"$T"'/rc.${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}"' \
        _ "$BIN" "$@" >"$T/stdout" 2>"$T/stderr"
    local rcs; rcs=$(cat "$T"/rc.* 2>/dev/null | sort -u | tr '\n' ' ')
    local lines; lines=$(grep -c 'error' "$T/stderr")
    if [ "$(ls "$T"/rc.* 2>/dev/null | wc -l)" = "$n" ] && ! grep -qx 0 "$T"/rc.* &&
       [ "$lines" = 1 ] && grep -q -- "$pat" "$T/stderr"; then ok
    else bad "$name: rcs '$rcs', $lines error lines: $(head -c 400 "$T/stderr")"; fi
}
RUNARGS=(run --checkpoint "$DATA/flux_tiny" --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/out.safetensors")
mpi_error product-vs-world 2 "needs 3 ranks" -- "${RUNARGS[@]}" --tp 3
mpi_error heads 4 "tp=4 does not divide 2 attention heads" -- "${RUNARGS[@]}" --tp 4
mpi_error mesh-order 2 "unknown axis 'foo'" -- "${RUNARGS[@]}" --tp 2 --mesh-order tp,foo,ulysses
export MESHDIT_TEST_SKIP_CP_SPLIT=1 # negative control: every rank computes the whole sequence
mpi_error skipped-cp-split 2 "no silent degrade.*computed the whole sequence" -- "${RUNARGS[@]}" --ulysses 2
H3ARGS=(run --checkpoint "$DATA/h3_heads8" --inputs "$DATA/h3_heads8/inputs.safetensors" --out "$T/out.safetensors")
mpi_error skipped-cp-split-h3 2 "no silent degrade.*computed the whole sequence" -- "${H3ARGS[@]}" --ring 2
unset MESHDIT_TEST_SKIP_CP_SPLIT
mpi_error h3-heads 3 "tp=3 does not divide 8 attention heads" -- "${H3ARGS[@]}" --tp 3
# a rank that fails or dies mid-load or mid-step at 4 ranks: every rank exits non-zero within 30 s,
# with the failing rank's message (stage:2 fails between two blocks, its peers already inside the
# next block's collectives: the agreement has its own communicator, so those cannot swallow it)
export MESHDIT_AGREE_TIMEOUT=5
for inj in load:2 step:2 stage:2 load:1:kill step:3:kill; do
    rm -f "$T"/rc.*
    start=$(date +%s)
    MESHDIT_TEST_FAIL=$inj timeout 60 "$MPIEXEC" -n 4 bash -c '"$@"; r=$?; echo $r > "'"$T"'/rc.${PMI_RANK:-0}"; exit $r' _ \
        "$BIN" "${H3ARGS[@]}" --tp 2 --ulysses 2 >"$T/stdout" 2>"$T/stderr"
    rc=$? elapsed=$(( $(date +%s) - start ))
    zero=$(cat "$T"/rc.* 2>/dev/null | grep -cx 0)
    msgs=$(grep -c "injected failure\|Killed\|BAD TERMINATION" "$T/stderr")
    if [ "$rc" != 0 ] && [ "$rc" != 124 ] && [ "$elapsed" -lt 30 ] && [ "$zero" = 0 ] && [ "$msgs" -ge 1 ] &&
       { case $inj in *kill) true;; *) [ "$(grep -c 'injected failure' "$T/stderr")" = 1 ];; esac; }; then ok
    else bad "failure $inj: mpiexec rc $rc after ${elapsed}s, $zero ranks exited 0: $(head -c 300 "$T/stderr")"; fi
done
unset MESHDIT_AGREE_TIMEOUT
expect_error max-memory 1 "tp=1 needs" "max-memory" -- "$BIN" run --checkpoint "$DATA/flux_tiny" \
    --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/out.safetensors" --max-memory 100K
# MiniMax-H3's timesteps size a table per block: more of them than packed rows is refused (no
# row reads them), and the estimate before the load counts them (18 rows + 3 x 19)
"$ST_EDIT" "$DATA/h3_tiny/inputs.safetensors" "$T/h3t.st" $(for i in $(seq 17); do printf 'timestep@grow '; done)
expect_error h3-timesteps 1 "timestep has 19 entries but the packed sequence has 18 rows" -- \
    "$BIN" run --checkpoint "$DATA/h3_tiny" --inputs "$T/h3t.st" --out "$T/out.safetensors"
expect_error h3-timesteps-memory 1 "batch 2 x 75 tokens" -- "$BIN" run --checkpoint "$DATA/h3_tiny" \
    --inputs "$T/h3t.st" --out "$T/out.safetensors" --max-memory 1K
# a model whose output is not the latent's shape cannot be sampled: both shapes are named
expect_error steps-shape 1 "the model output 'sample' \[2, 3, 6, 3, 10\] does not match the latent 'hidden_states' \[2, 4, 7, 3, 10\]" -- \
    "$BIN" run --checkpoint "$DATA/wan_odd" --inputs "$DATA/wan_odd/inputs.safetensors" --out "$T/out.safetensors" --steps 2
# each packed row holds one modality row, tagged as that modality (diffusers' index_copy would
# keep either of two, and a wrong tag picks another modality's AdaLN row)
"$ST_EDIT" "$DATA/h3_tiny/inputs.safetensors" "$T/h3d.st" video_indices@repeat
expect_error h3-row-twice 1 "video_indices\[1\] = .*a packed row video_indices\[0\] already takes" -- \
    "$BIN" run --checkpoint "$DATA/h3_tiny" --inputs "$T/h3d.st" --out "$T/out.safetensors"
"$ST_EDIT" "$DATA/h3_tiny/inputs.safetensors" "$T/h3g.st" token_tags@repeat
expect_error h3-row-tag 1 "but token_tags\[.*\] is 1, not 0 (0 video, 1 text, 2 audio)" -- \
    "$BIN" run --checkpoint "$DATA/h3_tiny" --inputs "$T/h3g.st" --out "$T/out.safetensors"
# the planner: every (tp, ring, ulysses) of 32 devices, ranked, invalid ones with their reason
if "$BIN" plan --config configs/minimax_h3.json --devices 32 --device trn2 --tokens 37800 >"$T/plan" &&
   grep -q "<- best" "$T/plan" && grep -q "rejected: tp=16 does not divide 56 attention heads" "$T/plan" &&
   grep -q "rejected: needs .* GiB per device" "$T/plan" &&
   [ "$(grep -c '^[0-9]* x [0-9]* x [0-9]* ' "$T/plan")" = 21 ]; then ok
else bad "plan: $(head -5 "$T/plan")"; fi
# a guided workload (two forwards a step) ranks cfg layouts beside the others: on two CPUs one
# branch per rank beats every split of one forward
if "$BIN" plan --config configs/qwen_image.json --devices 2 --tokens 4608 --txt-tokens 512 \
        --device cpu --device-mem 200 --guided >"$T/plan_g" &&
   grep -q "^2 x 1 x 1 x 1 .*<- best" "$T/plan_g" &&
   [ "$(grep -c '^[12] x [0-9]* x [0-9]* x [0-9]* ' "$T/plan_g")" = 4 ]; then ok
else bad "plan --guided: $(head -6 "$T/plan_g")"; fi
# a config that leaves sizes out plans as the model it loads: the family's defaults, not 1s
echo '{"_class_name": "FluxTransformer2DModel"}' >"$T/flux_min.json"
echo '{"_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 64,
  "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
  "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768}' \
    >"$T/flux_full.json"
if "$BIN" plan --config "$T/flux_min.json" --devices 8 --tokens 4352 --txt-tokens 256 \
        >"$T/plan_min" && "$BIN" plan --config "$T/flux_full.json" --devices 8 --tokens 4352 \
        --txt-tokens 256 >"$T/plan_full" && cmp -s "$T/plan_min" "$T/plan_full" &&
   grep -q "1658.2" "$T/plan_min"; then ok
else bad "plan of a config with defaults left out: $(diff "$T/plan_min" "$T/plan_full" | head -5)"; fi
expect_error plan-bytes 2 "--bytes" -- "$BIN" plan --config "$T/flux_min.json" --bytes -2
expect_error plan-device-mem 2 "--device-mem" -- "$BIN" plan --config "$T/flux_min.json" \
    --device-mem -5
expect_error plan-txt 1 "99999 text tokens leave no image row of the 10-token sequence" -- "$BIN" plan \
    --config "$T/flux_min.json" --tokens 10 --txt-tokens 99999
# Wan's text is cross-attended (its own rows): more text than video tokens is a valid plan, with
# or without blocks (a family property, not a guess from weight names)
echo '{"_class_name": "WanTransformer3DModel", "num_layers": 0}' >"$T/wan0.json"
if "$BIN" plan --config "$T/wan0.json" --devices 2 --tokens 64 --txt-tokens 128 >"$T/plan_wan0" &&
   grep -q "<- best" "$T/plan_wan0"; then ok
else bad "plan of a blockless Wan with more text than tokens: $(head -3 "$T/plan_wan0")"; fi
expect_error calibrate-plans 2 "--devices plans" -- "$BIN" plan --checkpoint "$DATA/flux_tiny" \
    --calibrate "$T/never.json" --devices 64
# calibration: two ranks of this host measure the kernels and each collective inside the host;
# the device file it writes is what plan --device-file predicts with (the cluster test measures
# the link between hosts)
if timeout 120 "$MPIEXEC" -n 2 "$BIN" plan --checkpoint "$DATA/flux_tiny" --calibrate "$T/dev.json" \
        --tokens 256 >"$T/cal" 2>&1 && grep -q '"calibrated":.*true' "$T/dev.json" &&
   [ "$(grep -c 'inside a host: ' "$T/cal")" = 4 ] && ! grep -q 'across hosts' "$T/cal" &&
   grep -q "links measured: intra" "$T/cal" &&
   "$BIN" plan --checkpoint "$DATA/flux_tiny" --device-file "$T/dev.json" --devices 2 \
        --tokens 256 --txt-tokens 48 --bytes 4 >"$T/plan" &&
   grep -q "(calibrated)" "$T/plan" && [ "$(grep -c '<- best' "$T/plan")" = 1 ]; then ok
else bad "plan --calibrate: $(head -c 600 "$T/cal") $(head -c 300 "$T/plan")"; fi
# a rate that makes every layout's step infinite is refused, naming it
sed 's/"attention":[^,}]*/"attention": 1e-300/' "$T/dev.json" >"$T/slowattn.json"
expect_error device-tiny-rate 1 "flops.attention must be 0 (the linear rate) or a number in" -- "$BIN" plan \
    --checkpoint "$DATA/flux_tiny" --device-file "$T/slowattn.json" --devices 2
echo '{"meshdit_device": 1, "name": "x", "flops": {"linear": 1e9}}' >"$T/baddev.json"
expect_error device-file 1 "baddev.json" "memory_bytes is missing" -- "$BIN" plan \
    --checkpoint "$DATA/flux_tiny" --device-file "$T/baddev.json" --devices 2
expect_error device-twice 2 "one of --device" -- "$BIN" plan --checkpoint "$DATA/flux_tiny" \
    --device cpu --device-file "$T/dev.json"
expect_error calibrate-nowhere 1 "/nonexistent/dev.json" -- "$BIN" plan \
    --checkpoint "$DATA/flux_tiny" --calibrate /nonexistent/dev.json --tokens 64
# memory at scale, on paper: the real MiniMax-H3 config (no weights) at tp=8 holds ~4.21 B
# parameters per rank upstream; ours must be within 2% (it shards adaln_proj too)
if "$BIN" inspect --config configs/minimax_h3.json --tp 8 --ulysses 4 >"$T/h3insp" &&
   awk '/^  tp=8 / { p = $2; exit } END { exit !(p > 4.21 * 0.98 && p < 4.21 * 1.02) }' "$T/h3insp" &&
   grep -q "^rank 31: tp 7, ring 0, ulysses 3" "$T/h3insp" &&
   grep -q "transformer_blocks.49.adaln_proj.linear.weight .*replicated-input-rowwise" "$T/h3insp"; then ok
else bad "inspect MiniMax-H3 at real size: $(grep 'tp=8 ' "$T/h3insp")"; fi
for layout in "--ulysses 2" "--ring 2" "--tp 2 --ulysses 2" "--ring 2 --ulysses 2 --mesh-order ring,ulysses,tp"; do
    n=1; for k in $layout; do case $k in [0-9]*) n=$((n * k));; esac; done
    if timeout 300 "$MPIEXEC" -n $n "$BIN" run --checkpoint "$DATA/flux_guidance" \
            --inputs "$DATA/flux_guidance/inputs.safetensors" --out "$T/cp.safetensors" $layout \
            --report "$T/cp.json" >"$T/cp.txt" 2>&1 &&
       "$BIN" compare "$T/cp.safetensors" "$DATA/flux_guidance/expected.safetensors" >/dev/null &&
       grep -q '"ring_wait_seconds"' "$T/cp.json" &&
       # the last step's blocked seconds per collective kind and in the world's agreement: every
       # rank waited in the agreement (the one world collective), and a Ulysses rank in its
       # all-to-alls (1 rank: none, below)
       [ "$(tr -d ' \t\n' <"$T/cp.json" | grep -o '"wait_seconds_last_step":{[^}]*}' |
            grep -c '"agreement":[0-9.]*[1-9]')" = "$n" ] &&
       { case "$layout" in *ulysses*)
             [ "$(tr -d ' \t\n' <"$T/cp.json" | grep -o '"wait_seconds_last_step":{[^}]*}' |
                  grep -c '"alltoall":[0-9.]*[1-9]')" = "$n" ];; esac; } &&
       # one world collective per forward (the agreement; each stage's NaN guard is local)
       [ "$(tr -d ' \t' <"$T/cp.json" | grep -o '"world_collectives_per_step":[0-9]*' | sort -u)" = \
         '"world_collectives_per_step":1' ]; then ok
    else bad "run $layout: $(tail -3 "$T/cp.txt"; grep world_collectives "$T/cp.json" | sort -u)"; fi
done
# negative control of the wait counters: one rank waits for nobody
if "$BIN" run --checkpoint "$DATA/flux_guidance" --inputs "$DATA/flux_guidance/inputs.safetensors" \
       --out "$T/cp1.safetensors" --report "$T/cp1.json" >/dev/null 2>&1 &&
   tr -d ' \t\n' <"$T/cp1.json" | grep -q '"last_step_seconds":[0-9.]*[1-9][^,]*,"wait_seconds_last_step":{"allreduce":0,"allgather":0,"alltoall":0,"sendrecv":0,"bcast":0,"agreement":0}'; then ok
else bad "one rank's report: waits not all zero or missing: $(grep -A7 wait_seconds "$T/cp1.json")"; fi
# every forward's seconds in order (rank 0's), three for --repeat 3, their middle the median
if "$BIN" run --checkpoint "$DATA/flux_guidance" --inputs "$DATA/flux_guidance/inputs.safetensors" \
       --out "$T/cp3.safetensors" --report "$T/cp3.json" --repeat 3 >/dev/null 2>&1 &&
   tr -d ' \t\n' <"$T/cp3.json" | awk '{
       if (!match($0, /"step_seconds":\[[^]]*\]/)) exit 1
       n = split(substr($0, RSTART + 16, RLENGTH - 17), v, ",")
       if (!match($0, /"step_seconds_median":[0-9.e+-]*/)) exit 1
       med = substr($0, RSTART + 22, RLENGTH - 22) + 0
       if (n != 3) exit 1
       for (i = 1; i <= 3; i++) { if (!(v[i] > 0)) exit 1; below += (v[i] + 0 < med); above += (v[i] + 0 > med) }
       exit !(below == 1 && above == 1) }'; then ok
else bad "--repeat 3 report: step_seconds: $(grep -A4 '"step_seconds' "$T/cp3.json")"; fi
# ... and beside them the hypervisor's steal per forward: three readings, each a number of
# seconds (>= 0) where /proc/stat is readable, else null (tests/mpi/test_steal: the values)
if tr -d ' \t\n' <"$T/cp3.json" | awk -v proc="$([ -r /proc/stat ] && echo 1)" '{
       if (!match($0, /"steal_seconds":\[[^]]*\]/)) exit 1
       n = split(substr($0, RSTART + 17, RLENGTH - 18), v, ",")
       if (n != 3) exit 1
       for (i = 1; i <= 3; i++) if (proc ? !(v[i] ~ /^[0-9.e+-]+$/ && v[i] + 0 >= 0) : v[i] != "null") exit 1 }'; then ok
else bad "--repeat 3 report: steal_seconds: $(grep -A4 '"steal_seconds"' "$T/cp3.json")"; fi

# --device cuda where no GPU can run it: one line saying why (no plugin in this build, or no
# CUDA device), exit 1, nothing written. On a machine with a GPU scripts/gpu-check covers it.
if ! nvidia-smi -L >/dev/null 2>&1; then
    ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0 expect_error device-cuda-no-gpu 1 \
        "error: --device cuda: " -- "$BIN" run --checkpoint "$DATA/flux_tiny" \
        --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/out.safetensors" --device cuda
fi
MESHDIT_CUDA_PLUGIN=/nonexistent/libmeshdit_cuda.so expect_error device-cuda-no-plugin 1 \
    "--device cuda: this build has no CUDA backend" -- "$BIN" run --checkpoint "$DATA/flux_tiny" \
    --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/out.safetensors" --device cuda
# --dtype bf16 on the CPU: says so, holds about half the weight bytes, and lands within 2e-2 of
# the diffusers golden (f32) but not on the f32 run's bits
if "$BIN" run --checkpoint "$DATA/flux_tiny" --inputs "$DATA/flux_tiny/inputs.safetensors" \
       --out "$T/b16.safetensors" --dtype bf16 --report "$T/b16.json" >"$T/b16.txt" &&
   grep -q '"weights_dtype":[[:space:]]*"bf16"' "$T/b16.json" &&
   "$BIN" run --checkpoint "$DATA/flux_tiny" --inputs "$DATA/flux_tiny/inputs.safetensors" \
       --out "$T/f32.safetensors" >"$T/f32.txt" &&
   grep -q '^device: cpu, compute bf16 \(weights\|x bf16 GEMM operands\)' "$T/b16.txt" &&
   "$BIN" compare "$T/b16.safetensors" "$DATA/flux_tiny/expected.safetensors" --tol 2e-2 >/dev/null &&
   ! "$BIN" compare "$T/b16.safetensors" "$T/f32.safetensors" --tol 1e-6 >/dev/null; then
    w16=$(sed -n 's/.*weights \([0-9.]*\) KiB.*/\1/p' "$T/b16.txt" | head -1)
    w32=$(sed -n 's/.*weights \([0-9.]*\) KiB.*/\1/p' "$T/f32.txt" | head -1)
    if awk -v a="$w16" -v b="$w32" 'BEGIN { exit !(a > 0 && a < 0.6 * b) }'; then ok
    else bad "bf16 weights $w16 KiB vs f32 $w32 KiB"; fi
else bad "run --dtype bf16 on the CPU"; fi
# no silent NaN: a finite but extreme weight (3e38 in x_embedder.weight) overflows f32 inside the
# forward; the run fails with one line naming the stage that went non-finite and writes nothing;
# with --steps 2 the error names step 1 and never blames the user's input
cp -r "$DATA/flux_tiny" "$T/hot"
hf="$T/hot/diffusion_pytorch_model.safetensors"
hl=$(od -An -t u8 -N8 "$hf" | tr -d ' ')
xo=$(head -c $((8 + hl)) "$hf" | tail -c "$hl" | grep -o '"x_embedder.weight":{[^}]*}' |
     sed -E 's/.*"data_offsets":\[([0-9]+),.*/\1/')
printf '\xe6\xb1\x61\x7f' | dd of="$hf" bs=1 seek=$((8 + hl + xo)) conv=notrunc status=none
expect_error extreme-weight 1 "output of x_embedder went non-finite" "rank 0" -- "$BIN" run --checkpoint "$T/hot" \
    --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/out.safetensors"
expect_error extreme-weight-steps 1 "step 1 of 2: " "went non-finite" -- "$BIN" run \
    --checkpoint "$T/hot" --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/out.safetensors" \
    --steps 2
if grep -q "hidden_states" "$T/stderr"; then bad "a step's non-finite output blamed on the input"
else ok; fi
expect_error extreme-weight-tp 1 "output of x_embedder went non-finite" -- "$MPIEXEC" -n 2 "$BIN" run --checkpoint \
    "$T/hot" --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/out.safetensors" --ulysses 2
# on two ranks with --steps the message names the step once and the rank once (an agreement
# around the step's must not prefix the rank again: 'rank 0: step 1 of 2: rank 0: ...')
expect_error extreme-weight-tp-steps 1 "^meshdit: error: step 1 of 2: rank 0: the output of x_embedder" -- \
    "$MPIEXEC" -n 2 "$BIN" run --checkpoint "$T/hot" --inputs "$DATA/flux_tiny/inputs.safetensors" \
    --out "$T/out.safetensors" --tp 2 --steps 2
# a block's output non-finite in TP rank 1's part of its replicated rows only (the test seam puts
# a NaN in the last image row of transformer_blocks.0; the next block's attention spreads it to
# every row): each TP rank scans its part, so rank 0 first sees it a block later, and the ranks
# must still name the earliest stage and element, as one rank does (negative control: the
# lowest failing rank's message would name single_transformer_blocks.0)
for lay in "1:480:" "2:480:--tp 2" "4:200:--tp 2 --ring 2"; do
    IFS=: read -r n e args <<<"$lay"
    MESHDIT_TEST_NAN=transformer_blocks.0:$e expect_error "nan-part-$n" 1 \
        "the output of transformer_blocks.0 went non-finite" "at element $e of its rows" -- \
        "$MPIEXEC" -n "$n" "$BIN" run --checkpoint "$DATA/flux_tiny" --inputs \
        "$DATA/flux_tiny/inputs.safetensors" --out "$T/out.safetensors" $args
done
# the step watchdog: SIGSTOP one rank of four mid-run; the job ends within the bound plus the
# grace period with exactly one error line naming that rank, and the waiting ranks sleep (each
# uses < 30% of a core while it waits) instead of spinning
rm -f "$T/wd.safetensors"
timeout 60 "$MPIEXEC" -n 4 "$BIN" run --checkpoint "$DATA/flux_tiny" --inputs \
    "$DATA/flux_tiny/inputs.safetensors" --out "$T/wd.safetensors" --steps 100000 --tp 2 \
    --ulysses 2 --step-timeout 3 >"$T/wd.out" 2>"$T/wd.err" &
wd_mpi=$!
sleep 2
wd_pids=() wd_victim=""
for p in $(pgrep -f "run --checkpoint $DATA/flux_tiny --inputs $DATA/flux_tiny/inputs.safetensors --out $T/wd.safetensors"); do
    r=$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | sed -n 's/^PMI_RANK=//p')
    if [ "$r" = 2 ]; then wd_victim=$p; elif [ -n "$r" ]; then wd_pids+=("$p"); fi
done
wd_t0=$(date +%s)
[ -n "$wd_victim" ] && kill -STOP "$wd_victim"
sleep 1
cpu0=0
for p in "${wd_pids[@]}"; do cpu0=$((cpu0 + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0))); done
sleep 1
cpu1=0
for p in "${wd_pids[@]}"; do cpu1=$((cpu1 + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0))); done
wait "$wd_mpi"
wd_rc=$?
wd_t=$(($(date +%s) - wd_t0))
[ -n "$wd_victim" ] && { kill -CONT "$wd_victim"; kill -9 "$wd_victim"; } 2>/dev/null
wd_lines=$(grep -c "meshdit: error:" "$T/wd.err")
if [ -n "$wd_victim" ] && [ "$wd_rc" != 0 ] && [ "$wd_t" -le 20 ] && [ "$wd_lines" = 1 ] &&
   grep -q "step watchdog: rank 2 did not reach" "$T/wd.err" &&
   [ $((cpu1 - cpu0)) -lt $((30 * ${#wd_pids[@]})) ] && [ ! -e "$T/wd.safetensors" ]; then ok
else bad "watchdog: rc $wd_rc after $wd_t s, $wd_lines error lines, cpu ticks $((cpu1 - cpu0)) for ${#wd_pids[@]} waiting ranks: $(head -c 300 "$T/wd.err")"; fi
# --max-memory counts bf16 linears at 2 bytes: 2.4M (weights + activations) refuses the f32
# weights (267.5 KiB + 2.2 MiB = 2.43 MiB), not bf16 (137.0 KiB + 2.2 MiB = 2.33 MiB)
if "$BIN" run --checkpoint "$DATA/flux_tiny" --inputs "$DATA/flux_tiny/inputs.safetensors" \
       --out "$T/b16.safetensors" --dtype bf16 --max-memory 2.4M --quiet; then ok
else bad "--dtype bf16 --max-memory 2.4M refused"; fi
expect_error max-memory-f32 1 "tp=1 needs" "of f32 weights" -- "$BIN" run \
    --checkpoint "$DATA/flux_tiny" --inputs "$DATA/flux_tiny/inputs.safetensors" \
    --out "$T/out.safetensors" --max-memory 2.4M
# MESHDIT_CPU_ISA: the baseline x86-64 kernels give the golden result and say so; a set that
# does not exist, or that this CPU cannot run, is a one-line error on every rank
if [ "$(uname -m)" = x86_64 ]; then
    if MESHDIT_CPU_ISA=x86-64 "$BIN" run --checkpoint "$DATA/flux_tiny" \
           --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/isa.safetensors" \
           --report "$T/isa.json" >"$T/isa.txt" &&
       grep -q 'cpu kernels x86-64' "$T/isa.txt" &&
       grep -q '"cpu_kernels":[[:space:]]*"x86-64"' "$T/isa.json" &&
       "$BIN" compare "$T/isa.safetensors" "$DATA/flux_tiny/expected.safetensors" >/dev/null; then ok
    else bad "MESHDIT_CPU_ISA=x86-64 run"; fi
    if ! grep -q avx512f /proc/cpuinfo; then
        MESHDIT_CPU_ISA=avx512 expect_error cpu-isa-missing 1 "CPU kernels 'avx512'" \
            "lacks the instructions" -- "$BIN" run --checkpoint "$DATA/flux_tiny" \
            --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/out.safetensors"
    fi
fi
MESHDIT_CPU_ISA=avx1024 expect_error cpu-isa-unknown 1 "CPU kernels 'avx1024': no such kernel set" \
    -- "$MPIEXEC" -n 2 "$BIN" run --checkpoint "$DATA/flux_tiny" \
    --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/out.safetensors" --tp 2
# MESHDIT_CPU_GEMM: each GEMM path gives the golden result and the plan line and report say which
# ran (bf16 weights: the operands too); an unknown path is a one-line error on every rank
for g in openblas onednn; do
    for dt in f32 bf16; do
        tol=1e-4; [ "$dt" = bf16 ] && tol=2e-2
        if MESHDIT_CPU_GEMM=$g "$BIN" run --checkpoint "$DATA/flux_tiny" --dtype $dt \
               --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/gemm.safetensors" \
               --report "$T/gemm.json" >"$T/gemm.txt" &&
           grep -q ", gemm $g" "$T/gemm.txt" &&
           grep -q "\"cpu_gemm\":[[:space:]]*\"$g" "$T/gemm.json" &&
           grep -q '"gemm_operands":[[:space:]]*"\(bf16\|f32\)"' "$T/gemm.json" &&
           "$BIN" compare "$T/gemm.safetensors" "$DATA/flux_tiny/expected.safetensors" \
               --tol $tol >/dev/null; then ok
        else bad "MESHDIT_CPU_GEMM=$g --dtype $dt run"; fi
    done
done
# MESHDIT_CPU_BF16: bf16 weights as bf16 GEMM operands or widened to f32, by measurement unless
# asked; the plan line and the report say which and why; both land on the golden
for b in auto widen operands; do
    want="widened to f32\|as bf16 GEMM operands"
    [ "$b" = widen ] && want="widened to f32 for the f32 GEMM (MESHDIT_CPU_BF16)"
    [ "$b" = operands ] && want="as bf16 GEMM operands (MESHDIT_CPU_BF16)"
    [ "$b" = auto ] && want="(measured on rank 0\|(no bf16 GEMM on this path)"
    if MESHDIT_CPU_BF16=$b "$BIN" run --checkpoint "$DATA/flux_tiny" --dtype bf16 \
           --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/bf.safetensors" \
           --report "$T/bf.json" >"$T/bf.txt" 2>&1; then
        if grep -q "^plan: .*bf16 weights .*\($want\)" "$T/bf.txt" &&
           grep -q '"bf16_path":[[:space:]]*"bf16 weights' "$T/bf.json" &&
           "$BIN" compare "$T/bf.safetensors" "$DATA/flux_tiny/expected.safetensors" \
               --tol 2e-2 >/dev/null; then ok
        else bad "MESHDIT_CPU_BF16=$b run: $(grep '^plan' "$T/bf.txt")"; fi
    elif [ "$b" = operands ] && grep -q "has no bf16 GEMM" "$T/bf.txt"; then ok # an AVX2 CPU
    else bad "MESHDIT_CPU_BF16=$b run failed: $(tail -1 "$T/bf.txt")"; fi
done
MESHDIT_CPU_BF16=fast expect_error cpu-bf16-unknown 1 "MESHDIT_CPU_BF16='fast': operands, widen or auto" \
    -- "$MPIEXEC" -n 2 "$BIN" run --checkpoint "$DATA/flux_tiny" --dtype bf16 \
    --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/out.safetensors" --tp 2
MESHDIT_CPU_GEMM=cublas expect_error cpu-gemm-unknown 1 "CPU GEMM 'cublas': no such GEMM path" \
    -- "$MPIEXEC" -n 2 "$BIN" run --checkpoint "$DATA/flux_tiny" \
    --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/out.safetensors" --tp 2
expect_error bad-device 2 "--device must be cpu or cuda" -- "$BIN" run --checkpoint x --inputs y \
    --out "$T/out.safetensors" --device tpu

# ---- outputs: checked before any weight is read, written both or neither, never over
# something that is not a regular file, with the umask's mode ----
ORUN=(run --inputs "$DATA/flux_tiny/inputs.safetensors" --quiet)
printf 'old output' >"$T/keep.safetensors"
cp "$T/keep.safetensors" "$T/keep.orig"
kept() { cmp -s "$T/keep.safetensors" "$T/keep.orig"; } # the old --out is as it was
expect_error report-no-dir 1 "--report: $T/nodir/r.json" "cannot create a file in its directory" -- \
    "$BIN" "${ORUN[@]}" --checkpoint "$DATA/flux_tiny" --out "$T/keep.safetensors" --report "$T/nodir/r.json"
kept && ok || bad "report-no-dir: --out was replaced"
mkdir "$T/rdir"
expect_error report-is-dir 1 "--report: $T/rdir: exists and is a directory" -- \
    "$BIN" "${ORUN[@]}" --checkpoint "$DATA/flux_tiny" --out "$T/keep.safetensors" --report "$T/rdir"
kept && [ -d "$T/rdir" ] && ok || bad "report-is-dir: --out replaced"
# before the weights: the truncated checkpoint is never read
expect_error out-no-dir-before-load 1 "--out: $T/nodir/o.safetensors" "cannot create a file" -- \
    "$BIN" "${ORUN[@]}" --checkpoint "$T/trunc" --out "$T/nodir/o.safetensors"
expect_error out-no-dir-before-load-mpi 1 "--out: $T/nodir/o.safetensors" -- "$MPIEXEC" -n 2 \
    "$BIN" "${ORUN[@]}" --checkpoint "$T/trunc" --out "$T/nodir/o.safetensors" --tp 2
mkdir "$T/odir"
expect_error out-is-dir 1 "--out: $T/odir: exists and is a directory" -- \
    "$BIN" "${ORUN[@]}" --checkpoint "$T/trunc" --out "$T/odir"
mkfifo "$T/fifo"
expect_error out-is-fifo 1 "exists and is a FIFO, not a regular file" -- \
    "$BIN" "${ORUN[@]}" --checkpoint "$DATA/flux_tiny" --out "$T/fifo"
[ -p "$T/fifo" ] && [ -d "$T/odir" ] && ok || bad "out-is-fifo/dir: replaced by a file"
expect_error inputs-out-is-fifo 1 "exists and is a FIFO" -- \
    "$BIN" inputs --checkpoint "$DATA/flux_tiny" --out "$T/fifo"
# a symbolic link as --out or --report is refused; it and the file it points to stay as they were
ln -s keep.safetensors "$T/link.safetensors"
expect_error out-is-symlink 1 "--out: $T/link.safetensors: is a symbolic link" -- \
    "$BIN" "${ORUN[@]}" --checkpoint "$DATA/flux_tiny" --out "$T/link.safetensors"
expect_error report-is-symlink 1 "--report: $T/link.safetensors: is a symbolic link" -- \
    "$BIN" "${ORUN[@]}" --checkpoint "$DATA/flux_tiny" --out "$T/o.safetensors" --report "$T/link.safetensors"
[ -L "$T/link.safetensors" ] && kept && ok ||
    bad "out-is-symlink: the link or its target changed"
expect_error out-is-report 1 "name the same file" -- "$BIN" "${ORUN[@]}" \
    --checkpoint "$DATA/flux_tiny" --out "$T/same.json" --report "$T/./same.json"
# an output never replaces a file the command reads: the checkpoint's config, weights, index or
# shards, the inputs, an adapter; each refused before any work, and each file left as it was
mkdir -p "$T/ck" && cp "$DATA/flux_tiny/config.json" "$DATA/flux_tiny/diffusion_pytorch_model.safetensors" \
    "$DATA/flux_tiny/inputs.safetensors" "$T/ck/" && cp "$DATA/lora/flux_tiny/a.safetensors" "$T/ck/a.safetensors"
sum_ck() { cat "$T"/ck/* | cksum; }
ck_before=$(sum_ck)
CKRUN=(run --checkpoint "$T/ck" --inputs "$T/ck/inputs.safetensors" --quiet)
expect_error out-is-weights 1 "--out $T/ck/diffusion_pytorch_model.safetensors is the checkpoint's diffusion_pytorch_model.safetensors" -- \
    "$BIN" "${CKRUN[@]}" --out "$T/ck/diffusion_pytorch_model.safetensors"
expect_error out-is-config 1 "is the checkpoint's config.json" -- \
    "$BIN" "${CKRUN[@]}" --out "$T/ck/config.json"
expect_error out-is-inputs 1 "--out $T/ck/./inputs.safetensors is the input file $T/ck/inputs.safetensors" -- \
    "$BIN" "${CKRUN[@]}" --out "$T/ck/./inputs.safetensors"
expect_error report-is-inputs 1 "--report $T/ck/inputs.safetensors is the input file" -- \
    "$BIN" "${CKRUN[@]}" --out "$T/o.safetensors" --report "$T/ck/inputs.safetensors"
expect_error out-is-lora 1 "is the input file $T/ck/a.safetensors" -- \
    "$BIN" "${CKRUN[@]}" --out "$T/ck/a.safetensors" --lora "$T/ck/a.safetensors:0.5"
ln "$T/ck/inputs.safetensors" "$T/hardlink.safetensors"
expect_error out-is-hardlinked-inputs 1 "is the input file" -- \
    "$BIN" "${CKRUN[@]}" --out "$T/hardlink.safetensors"
rm -f "$T/hardlink.safetensors"
expect_error inputs-out-is-weights 1 "is the checkpoint's diffusion_pytorch_model.safetensors" -- \
    "$BIN" inputs --checkpoint "$T/ck" --out "$T/ck/diffusion_pytorch_model.safetensors"
expect_error calibrate-is-config 1 "--calibrate $T/ck/config.json is the checkpoint's config.json" -- \
    "$BIN" plan --checkpoint "$T/ck" --calibrate "$T/ck/config.json"
[ "$(sum_ck)" = "$ck_before" ] && ok || bad "out-is-input: a file the command reads changed"
"$BIN" gen --model flux --preset tiny --shards 2 --out "$T/cksh" >/dev/null
shard1=diffusion_pytorch_model-00001-of-00002.safetensors
sh_before=$(cksum <"$T/cksh/$shard1")
expect_error out-is-shard 1 "is the checkpoint's $shard1" -- \
    "$BIN" run --checkpoint "$T/cksh" --inputs "$DATA/flux_tiny/inputs.safetensors" --quiet --out "$T/cksh/$shard1"
[ "$(cksum <"$T/cksh/$shard1")" = "$sh_before" ] && ok || bad "out-is-shard: the shard changed"
# a one-file checkpoint written over a sharded one would be shadowed by the old index: refused,
# the old checkpoint left whole (gen and gather)
cfg_before=$(cksum <"$T/cksh/config.json")
expect_error gen-over-index 1 "$T/cksh holds a sharded checkpoint's diffusion_pytorch_model.safetensors.index.json" -- \
    "$BIN" gen --model flux --preset tiny --seed 3 --out "$T/cksh"
expect_error gather-over-index 1 "holds a sharded checkpoint's" -- \
    "$BIN" gather --checkpoint "$T/cksh" --out "$T/cksh"
[ "$(cksum <"$T/cksh/config.json")" = "$cfg_before" ] && [ ! -e "$T/cksh/diffusion_pytorch_model.safetensors" ] &&
    [ "$(cksum <"$T/cksh/$shard1")" = "$sh_before" ] && ok || bad "gen-over-index: the old checkpoint changed"
# a key repeated in config.json: this reader would take the first, diffusers the last
mkdir -p "$T/dupk" && cp "$DATA/flux_tiny/diffusion_pytorch_model.safetensors" "$T/dupk/" &&
    sed 's/}[[:space:]]*$/, "num_attention_heads": 4}/' "$DATA/flux_tiny/config.json" >"$T/dupk/config.json"
expect_error config-key-twice 1 "$T/dupk/config.json: key 'num_attention_heads' appears twice" -- \
    "$BIN" run --checkpoint "$T/dupk" --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/out.safetensors"
expect_error config-key-twice-inspect 1 "key 'num_attention_heads' appears twice" -- \
    "$BIN" inspect --config "$T/dupk/config.json"
# null is an Optional argument's absent value (out_channels: null loads), never a number's
# default: diffusers fails on num_layers=None
sed 's/"num_layers": [0-9]*/"num_layers": null/' "$DATA/flux_tiny/config.json" >"$T/nulls.json"
expect_error config-null 1 "'num_layers' is null, but it must be an integer" -- \
    "$BIN" inspect --config "$T/nulls.json"
# a bool's null is diffusers' None, false: Flux.2's guidance_embeds (default true) off
sed 's/"guidance_embeds": [a-z]*/"guidance_embeds": null/' "$DATA/flux2_guidance/config.json" >"$T/gnull.json"
if "$BIN" inspect --config "$T/gnull.json" >"$T/gnull" && ! grep -q guidance_embedder "$T/gnull" &&
   "$BIN" inspect --config "$DATA/flux2_guidance/config.json" | grep -q guidance_embedder; then ok
else bad "guidance_embeds: null is not false"; fi
perl -0pe 's/"axes_dims_rope": \[[^\]]*\]/"axes_dims_rope": null/s' "$DATA/flux_tiny/config.json" >"$T/anull.json"
expect_error config-null-array 1 "'axes_dims_rope' is null, but it must be an array" -- \
    "$BIN" inspect --config "$T/anull.json"
# a config key's error names the file it came from, not a generic config.json
sed 's/"num_attention_heads": 2/"num_attention_heads": "two"/' "$DATA/flux_tiny/config.json" >"$T/other.json"
expect_error config-named 1 "error: $T/other.json: 'num_attention_heads' must be an integer" -- \
    "$BIN" inspect --config "$T/other.json"
# a word no option takes, or a single-dash option, is refused, never dropped (run -steps 50 ran
# one forward); --help after a command prints the usage and runs nothing
expect_error stray-word 2 "unexpected argument 'junk'" -- \
    "$BIN" "${ORUN[@]}" --checkpoint "$DATA/flux_tiny" --out "$T/out.safetensors" junk
expect_error flag-with-value 2 "unexpected argument '1'" -- "$BIN" run --inputs "$DATA/flux_tiny/inputs.safetensors" \
    --checkpoint "$DATA/flux_tiny" --out "$T/out.safetensors" --quiet 1
expect_error single-dash 2 "unknown option -steps (options start with --)" -- \
    "$BIN" "${ORUN[@]}" --checkpoint "$DATA/flux_tiny" --out "$T/out.safetensors" -steps 50
# inputs too large for this process's memory are refused before they are made
expect_error inputs-too-large 1 "inputs of batch 64 and 4096 tokens in their longest stream take up to" -- \
    env MESHDIT_MEM_AVAILABLE=1M "$BIN" inputs --checkpoint "$DATA/flux_tiny" --batch 64 --img-tokens 4096 --out "$T/out.safetensors"
# inputs: an option the model has no input for is refused, not dropped from the file
expect_error inputs-negative-h3 1 "--negative: MiniMaxH3Transformer3DModel has no unconditional branch" -- \
    "$BIN" inputs --checkpoint "$DATA/h3_tiny" --negative --out "$T/out.safetensors"
expect_error inputs-guidance 1 "--guidance: this FluxTransformer2DModel takes no guidance input" -- \
    "$BIN" inputs --checkpoint "$DATA/flux_tiny" --guidance 2 --out "$T/out.safetensors"
expect_error inputs-audio 1 "--audio-tokens: FluxTransformer2DModel has no audio stream" -- \
    "$BIN" inputs --checkpoint "$DATA/flux_tiny" --audio-tokens 5 --out "$T/out.safetensors"
[ ! -e "$T/out.safetensors" ] && ok || bad "a refused inputs command wrote its file"
expect_error inputs-stray-word 2 "unexpected argument 'junk'" -- \
    "$BIN" inputs --checkpoint "$DATA/flux_tiny" --out "$T/out.safetensors" junk
# an argument echoed in an error is escaped: a newline or ESC cannot split the line or reach the
# terminal
"$BIN" inspect --checkpoint "$DATA/flux_tiny" --tp "$(printf 'x\033[31m\ny')" 2>"$T/esc_err" >/dev/null
if head -1 "$T/esc_err" | grep -qF "got 'x\x1b[31m\x0ay'"; then ok; else bad "an echoed argument is not escaped: $(head -2 "$T/esc_err")"; fi
# numbers as written: no blanks or '+' in an integer, no value for a flag, no number that is not
# 0 read as 0 (1e-400), a device of at least 1 MiB, an image row left in a plan's sequence
expect_error int-blank 2 "--tp must be an integer in" -- "$BIN" inspect --checkpoint "$DATA/flux_tiny" --tp " 2"
expect_error int-plus 2 "--tp must be an integer in" -- "$BIN" inspect --checkpoint "$DATA/flux_tiny" --tp +2
expect_error flag-equals 2 "option --quiet=1: --quiet takes no value" -- "$BIN" "${ORUN[@]}" \
    --checkpoint "$DATA/flux_tiny" --out "$T/out.safetensors" --quiet=1
expect_error cache-underflow 2 "threshold=1e-400 is not a number" -- "$BIN" "${ORUN[@]}" \
    --checkpoint "$DATA/flux_tiny" --out "$T/out.safetensors" --steps 2 --cache first_block:threshold=1e-400
expect_error plan-device-mem-tiny 2 "--device-mem must be a size in GiB in \[0.001" -- "$BIN" plan \
    --checkpoint "$DATA/flux_tiny" --devices 2 --device-mem 1e-300
expect_error plan-txt-all 1 "10 text tokens leave no image row of the 10-token sequence" -- "$BIN" plan \
    --checkpoint "$DATA/flux_tiny" --devices 2 --tokens 10 --txt-tokens 10
expect_error tol-underflow 2 "--tol must be a finite decimal number, got '1e-400'" -- \
    "$BIN" compare "$DATA/flux_tiny/expected.safetensors" "$DATA/flux_tiny/expected.safetensors" --tol 1e-400
expect_error lora-scale-underflow 1 "the scale '1e-400' after the last ':' is not a finite decimal" -- \
    "$BIN" "${ORUN[@]}" --checkpoint "$DATA/flux_tiny" --out "$T/out.safetensors" --lora "$DATA/lora/flux_tiny/a.safetensors:1e-400"
expect_error size-hex 2 "--max-memory takes a size like 512M, 8G or 1048576, got '0x10'" -- "$BIN" "${ORUN[@]}" \
    --checkpoint "$DATA/flux_tiny" --out "$T/out.safetensors" --max-memory 0x10
expect_error inputs-mem-env 1 "MESHDIT_MEM_AVAILABLE='bogus' is not a size" -- \
    env MESHDIT_MEM_AVAILABLE=bogus "$BIN" inputs --checkpoint "$DATA/flux_tiny" --out "$T/out.safetensors"
expect_error layout-too-large 2 "is 33554432 ranks; at most 65536" -- \
    "$BIN" inspect --checkpoint "$DATA/flux_tiny" --tp 2 --ring 4096 --ulysses 4096
# an unknown option takes the next word as its value: it is named, not the word after it
expect_error unknown-first 2 "unknown option --bogus" -- \
    "$BIN" run --bogus --checkpoint "$DATA/flux_tiny" --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/out.safetensors"
# a count of 0 is no --steps and no watchdog bound: refused, not read as the option's absence;
# numbers are plain decimals (no hex floats)
expect_error steps-zero 2 "--steps must be an integer in .1, 100000., got .0." -- "$BIN" "${ORUN[@]}" \
    --checkpoint "$DATA/flux_tiny" --out "$T/out.safetensors" --steps 0
expect_error step-timeout-zero 2 "--step-timeout must be an integer in .1, " -- "$BIN" "${ORUN[@]}" \
    --checkpoint "$DATA/flux_tiny" --out "$T/out.safetensors" --step-timeout 0
expect_error hex-scale 2 "--guidance-scale must be a finite decimal number, got '0x10'" -- "$BIN" "${ORUN[@]}" \
    --checkpoint "$DATA/flux_tiny" --out "$T/out.safetensors" --steps 2 --guidance-scale 0x10
expect_error hex-tol 2 "--tol must be a finite decimal number, got '0x1p-3'" -- \
    "$BIN" compare "$DATA/flux_tiny/expected.safetensors" "$DATA/flux_tiny/expected.safetensors" --tol 0x1p-3
# integer tensors compare exactly (they were a dtype mismatch): an inputs file with itself; an id
# off by one fails whatever --tol
"$ST_EDIT" "$DATA/flux_tiny/inputs.safetensors" "$T/ids_i64.st" img_ids=I64
"$ST_EDIT" "$DATA/flux_tiny/inputs.safetensors" "$T/ids_i64b.st" img_ids@repeat img_ids=I64
if ! "$BIN" compare "$T/ids_i64b.st" "$T/ids_i64.st" --tol 100 >"$T/cmpx" && grep -q "img_ids .*FAIL (tol 0.0e+00)" "$T/cmpx"; then ok
else bad "integer tensors that differ passed compare: $(cat "$T/cmpx")"; fi
# integer tensors compare exactly (they were a dtype mismatch): an inputs file with itself
if "$BIN" compare "$DATA/qwenimage_tiny/inputs.safetensors" "$DATA/qwenimage_tiny/inputs.safetensors" >"$T/cmpi" &&
   grep -q "img_shapes .*rel 0.000e+00  OK" "$T/cmpi"; then ok; else bad "compare of integer tensors: $(cat "$T/cmpi")"; fi
expect_error compare-third-file 2 "unexpected argument" -- \
    "$BIN" compare "$DATA/flux_tiny/expected.safetensors" "$DATA/flux_tiny/expected.safetensors" "$DATA/flux_tiny/inputs.safetensors"
if "$BIN" gen --help >"$T/help" 2>"$T/stderr" && grep -q "usage: meshdit" "$T/help" && [ ! -s "$T/stderr" ] &&
   "$BIN" run --checkpoint "$DATA/flux_tiny" --out "$T/out.safetensors" --help >/dev/null && [ ! -e "$T/out.safetensors" ]; then ok
else bad "subcommand --help: not the usage with status 0"; fi
# arguments that were accepted and then had no effect, or were silently clamped
OUTO=(--checkpoint "$DATA/flux_tiny" --out "$T/out.safetensors")
expect_error repeat-with-steps 2 "give one of them" -- "$BIN" "${ORUN[@]}" "${OUTO[@]}" --steps 2 --repeat 3
expect_error nccl-on-cpu 2 "--comm nccl runs the collectives on GPUs" -- "$BIN" "${ORUN[@]}" "${OUTO[@]}" --comm nccl
expect_error seed-out-of-range 2 "--seed must be an integer" -- \
    "$BIN" inputs "${OUTO[@]}" --seed 18446744073709551615
expect_error mesh-order-comma 1 "ends with a comma" -- "$BIN" "${ORUN[@]}" "${OUTO[@]}" --mesh-order tp,ring,ulysses,
expect_error lora-empty 1 "--lora '': no file name" -- "$BIN" "${ORUN[@]}" "${OUTO[@]}" --lora ""
expect_error plan-bytes-3 2 "--bytes is the weights' element size" -- \
    "$BIN" plan --config "$DATA/flux_tiny/config.json" --devices 2 --bytes 3
expect_error compare-negative-tol 2 "--tol must be a number >= 0" -- \
    "$BIN" compare --tol -1 "$DATA/flux_tiny/expected.safetensors" "$DATA/flux_tiny/expected.safetensors"
expect_error gen-model-not-config 1 "model 'wan' given, but" "is a FluxTransformer2DModel config" -- \
    "$BIN" gen --model wan --config "$DATA/flux_tiny/config.json" --out "$T/gm"
expect_error gen-model-unknown 1 "unknown model 'sd3'" -- \
    "$BIN" gen --model sd3 --config "$DATA/flux_tiny/config.json" --out "$T/gm"
[ ! -e "$T/gm" ] && ok || bad "gen-model-not-config: wrote $T/gm"
# inspect reads --lora FILE:SCALE as run does: the scale multiplies the adapter's own
s1=$("$BIN" inspect --checkpoint "$DATA/flux_tiny" --lora "$DATA/lora/flux_tiny/a.safetensors" | awk '/^adapter/ {a = 1} a && /linear_1.weight/ {print $4; exit}')
s5=$("$BIN" inspect --checkpoint "$DATA/flux_tiny" --lora "$DATA/lora/flux_tiny/a.safetensors:0.5" | awk '/^adapter/ {a = 1} a && /linear_1.weight/ {print $4; exit}')
[ -n "$s1" ] && awk -v a="$s1" -v b="$s5" 'BEGIN { exit !(b == a * 0.5) }' && ok ||
    bad "inspect --lora FILE:0.5: scale '$s5' is not half of '$s1'"
# tensors the model does not read are a warning naming how many and the first by name (here
# the config says no single blocks: single_transformer_blocks.0.* is left over)
mkdir -p "$T/unused" && cp "$DATA/flux_tiny/diffusion_pytorch_model.safetensors" "$T/unused/" &&
    sed 's/"num_single_layers": 1/"num_single_layers": 0/' "$DATA/flux_tiny/config.json" >"$T/unused/config.json"
if "$BIN" run --checkpoint "$T/unused" --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/unused.safetensors" \
       --quiet 2>"$T/stderr" &&
   grep -q "tensors in the checkpoint are not used by the model (the first by name: 'single_transformer_blocks.0." "$T/stderr"
then ok; else bad "unused tensors: $(cat "$T/stderr")"; fi
# compare: an empty reference compares nothing and is no pass; a tensor only in A is said
printf '\x08\x00\x00\x00\x00\x00\x00\x00{}      ' >"$T/empty.safetensors"
"$BIN" compare "$T/empty.safetensors" "$T/empty.safetensors" >"$T/stdout" 2>&1
rc_empty=$?
"$BIN" compare "$DATA/flux_tiny/inputs.safetensors" "$T/empty.safetensors" >"$T/stdout2" 2>&1
rc_extra=$?
if [ "$rc_empty" = 1 ] && grep -q "holds no tensors" "$T/stdout" && [ "$rc_extra" = 1 ] &&
   grep -q "EXTRA in $DATA/flux_tiny/inputs.safetensors" "$T/stdout2"; then ok
else bad "compare with an empty reference ($rc_empty) or extra tensors ($rc_extra): $(cat "$T/stdout" "$T/stdout2")"; fi
# a 255-byte file name works (NAME_MAX); 256 bytes is refused before the weights are read
n255=$(printf 'n%.0s' $(seq 243)).safetensors r255=$(printf 'r%.0s' $(seq 250)).json
if "$BIN" "${ORUN[@]}" --checkpoint "$DATA/flux_tiny" --out "$T/$n255" --report "$T/$r255" &&
   "$BIN" compare "$T/$n255" "$DATA/flux_tiny/expected.safetensors" >/dev/null && [ -s "$T/$r255" ]; then ok
else bad "255-byte --out and --report names"; fi
rm -f "$T/$n255" "$T/$r255"
expect_error out-name-256 1 "the file name is 256 bytes" "NAME_MAX" -- \
    "$BIN" "${ORUN[@]}" --checkpoint "$T/trunc" --out "$T/x$n255"
# the umask decides the mode of outputs and generated checkpoints (0666 & ~umask)
modes() { for f in "$@"; do stat -c %a "$f"; done | sort -u | tr '\n' ' '; }
for um in 022 077; do
    rm -rf "$T/um"; mkdir "$T/um"
    want=$(printf '%o' $((0666 & ~0$um)))
    if (umask $um &&
        "$BIN" "${ORUN[@]}" --checkpoint "$DATA/flux_tiny" --out "$T/um/o.safetensors" --report "$T/um/r.json" &&
        "$BIN" gen --model flux --preset tiny --out "$T/um/g" --shards 2 >/dev/null &&
        "$BIN" gen --model flux --preset tiny --out "$T/um/g1" >/dev/null &&
        "$BIN" inputs --checkpoint "$T/um/g" --out "$T/um/in.safetensors" >/dev/null &&
        "$BIN" gather --checkpoint "$T/um/g" --out "$T/um/gg" >/dev/null) &&
       [ "$(modes "$T"/um/*.* "$T"/um/g/* "$T"/um/g1/* "$T"/um/gg/*)" = "$want " ]; then ok
    else bad "umask $um: modes $(modes "$T"/um/*.* "$T"/um/g/* "$T"/um/g1/* "$T"/um/gg/*), wanted $want"; fi
done
ls -A "$T" "$T/um" "$T/um/g" | grep -q '^\.mdt-' && bad "outputs left a temporary file" || ok

# ---- memory: weights + activations per rank, checked before any weight is read ----
# flux_tiny needs 267.5 KiB of f32 weights + 2.2 MiB of activations on one rank (the estimate is
# arithmetic on the config and the inputs, so these thresholds are exact): 1M holds the weights
# but not the activations
expect_error max-memory-activations 1 "tp=1 needs 2.4 MiB per rank" "of activations" \
    "--max-memory limit of 1.0 MiB" -- "$BIN" "${ORUN[@]}" --checkpoint "$DATA/flux_tiny" \
    --out "$T/out.safetensors" --max-memory 1M
# without --max-memory: the memory this process may use (MESHDIT_MEM_AVAILABLE stands in for
# what /proc/meminfo and the cgroup say), refused before the weights (the truncated checkpoint
# is never read), naming the smallest TP degree that fits
MESHDIT_MEM_AVAILABLE=2.35M expect_error mem-default 1 "tp=1 needs 2.4 MiB per rank" \
    "MESHDIT_MEM_AVAILABLE: 2.3 MiB for the 1 rank on this node" "tp=2 would need 2.3 MiB" -- \
    "$BIN" "${ORUN[@]}" --checkpoint "$T/trunc" --out "$T/out.safetensors"
if MESHDIT_MEM_AVAILABLE=2.5M "$BIN" "${ORUN[@]}" --checkpoint "$DATA/flux_tiny" --out "$T/mem.safetensors" &&
   MESHDIT_MEM_AVAILABLE=1M "$BIN" "${ORUN[@]}" --checkpoint "$DATA/flux_tiny" --out "$T/mem.safetensors" --max-memory 3M &&
   "$BIN" compare "$T/mem.safetensors" "$DATA/flux_tiny/expected.safetensors" >/dev/null; then ok
else bad "MESHDIT_MEM_AVAILABLE=2.5M, or --max-memory over a smaller default, refused a run that fits"; fi
MESHDIT_MEM_AVAILABLE=lots expect_error mem-env-bad 1 "MESHDIT_MEM_AVAILABLE='lots' is not a size" -- \
    "$BIN" "${ORUN[@]}" --checkpoint "$DATA/flux_tiny" --out "$T/out.safetensors"
# the ranks on one node share its memory: 2 ranks at tp=2 need 2 x 2.3 MiB
MESHDIT_MEM_AVAILABLE=4M mpi_error mem-default-node 2 "for the 2 ranks on this node" -- \
    "${ORUN[@]}" --checkpoint "$DATA/flux_tiny" --out "$T/out.safetensors" --tp 2
if MESHDIT_MEM_AVAILABLE=5M timeout 300 "$MPIEXEC" -n 2 "$BIN" "${ORUN[@]}" --checkpoint "$DATA/flux_tiny" \
       --out "$T/mem2.safetensors" --tp 2 && [ -f "$T/mem2.safetensors" ]; then ok
else bad "MESHDIT_MEM_AVAILABLE=5M refused 2 ranks at tp=2"; fi

# ---- hostile checkpoint files: names, paths, non-regular files, sizes ----
# write_st PATH HEADER NDATA: a safetensors file with that JSON header and NDATA zero data bytes
write_st() {
    local n; n=$(printf '%s' "$2" | wc -c)
    printf "$(printf '\\%03o' $((n & 255)) $(((n >> 8) & 255)) $(((n >> 16) & 255)) $(((n >> 24) & 255)) 0 0 0 0)" >"$1"
    printf '%s' "$2" >>"$1"
    head -c "$3" /dev/zero >>"$1"
}
# strings from files are escaped in messages: a newline or a terminal escape in a tensor name,
# a dtype or _class_name never forges a second "meshdit: error:" line
mkdir -p "$T/esc"
cp "$DATA/flux_tiny/config.json" "$T/esc/"
write_st "$T/esc/diffusion_pytorch_model.safetensors" \
    '{"w\nmeshdit: error: forged\u001b[31m":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}' 4
expect_error escaped-tensor-name 1 "tensor 'w\\\\x0ameshdit: error: forged\\\\x1b\\[31m'" -- \
    "$BIN" run --checkpoint "$T/esc" --inputs "$DATA/flux_tiny/inputs.safetensors" --out "$T/out.safetensors"
write_st "$T/esc/diffusion_pytorch_model.safetensors" \
    '{"w":{"dtype":"F32\nmeshdit: error: forged","shape":[1],"data_offsets":[0,4]}}' 4
expect_error escaped-dtype 1 "dtype 'F32\\\\x0ameshdit: error: forged'" -- \
    "$BIN" inspect --checkpoint "$T/esc"
printf '{"_class_name": "Flux\\nmeshdit: error: forged\\u001b[0m"}' >"$T/esc/config.json"
expect_error escaped-class-name 1 "model class 'Flux\\\\x0ameshdit: error: forged\\\\x1b\\[0m'" -- \
    "$BIN" inspect --config "$T/esc/config.json"

# a FIFO as config.json, index, shard or --inputs, or a directory as config.json: one line naming
# the path, at once (before the fix they blocked in open() forever; timeout turns that into 124)
mkdir -p "$T/fifodir"
cp "$DATA/flux_bf16_sharded/"*.json "$DATA/flux_bf16_sharded/"*.safetensors "$T/fifodir/"
S2FIFO=diffusion_pytorch_model-00002-of-00002.safetensors
FIFOARGS=(run --checkpoint "$T/fifodir" --inputs "$DATA/flux_bf16_sharded/inputs.safetensors" --out "$T/out.safetensors")
for f in config.json diffusion_pytorch_model.safetensors.index.json \
         diffusion_pytorch_model-00002-of-00002.safetensors; do
    mv "$T/fifodir/$f" "$T/fifodir/$f.keep" && mkfifo "$T/fifodir/$f"
    expect_error "fifo-$f" 1 "$f: not a regular file (a FIFO)" -- timeout 20 "$BIN" "${FIFOARGS[@]}"
    rm "$T/fifodir/$f" && mv "$T/fifodir/$f.keep" "$T/fifodir/$f"
done
mkfifo "$T/fifodir/in.safetensors"
expect_error fifo-inputs 1 "in.safetensors: not a regular file (a FIFO)" -- timeout 20 "$BIN" run \
    --checkpoint "$T/fifodir" --inputs "$T/fifodir/in.safetensors" --out "$T/out.safetensors"
expect_error fifo-compare 1 "in.safetensors: not a regular file" -- timeout 20 "$BIN" compare \
    "$T/fifodir/in.safetensors" "$DATA/flux_tiny/expected.safetensors"
expect_error fifo-config 1 "in.safetensors: not a regular file" -- timeout 20 "$BIN" inspect \
    --config "$T/fifodir/in.safetensors"
mpi_error fifo-inputs-2-ranks 2 "in.safetensors: not a regular file (a FIFO)" -- run --checkpoint \
    "$T/fifodir" --inputs "$T/fifodir/in.safetensors" --out "$T/out.safetensors" --tp 2
mv "$T/fifodir/$S2FIFO" "$T/fifodir/$S2FIFO.keep" && mkfifo "$T/fifodir/$S2FIFO"
mpi_error fifo-shard-2-ranks 2 "$S2FIFO: not a regular file (a FIFO)" -- "${FIFOARGS[@]}" --tp 2
rm "$T/fifodir/$S2FIFO" && mv "$T/fifodir/$S2FIFO.keep" "$T/fifodir/$S2FIFO"
mv "$T/fifodir/config.json" "$T/fifodir/config.json.keep" && mkdir "$T/fifodir/config.json"
expect_error dir-config 1 "config.json: not a regular file (a directory)" -- "$BIN" "${FIFOARGS[@]}"
rmdir "$T/fifodir/config.json" && mv "$T/fifodir/config.json.keep" "$T/fifodir/config.json"
# shard names are plain file names in the checkpoint directory; a symlinked shard is followed
# (Hugging Face caches), but one that is not a safetensors file says so, without its bytes
mkdir -p "$T/paths"
cp "$DATA/flux_bf16_sharded/"*.json "$DATA/flux_bf16_sharded/"*.safetensors "$T/paths/"
IDX="$T/paths/diffusion_pytorch_model.safetensors.index.json"
cp "$IDX" "$T/paths.index.keep"
PATHARGS=(run --checkpoint "$T/paths" --inputs "$DATA/flux_bf16_sharded/inputs.safetensors" --out "$T/out.safetensors")
for name in /etc/passwd ../flux_tiny/diffusion_pytorch_model.safetensors ..; do
    sed "s|diffusion_pytorch_model-00002-of-00002.safetensors|$name|" "$T/paths.index.keep" >"$IDX"
    expect_error "shard-name-$name" 1 "shard name '$name' is not a plain file name" -- "$BIN" "${PATHARGS[@]}"
done
cp "$T/paths.index.keep" "$IDX"
S2=diffusion_pytorch_model-00002-of-00002.safetensors
mv "$T/paths/$S2" "$T/blob-s2" && ln -s "$T/blob-s2" "$T/paths/$S2"
if "$BIN" "${PATHARGS[@]}" --quiet; then ok; else bad "a symlinked shard is refused"; fi
printf 'root:x:0:0:root:/root:/bin/bash\n' >"$T/text-file"
ln -sf "$T/text-file" "$T/paths/$S2"
expect_error shard-not-safetensors 1 "$S2: not a safetensors file: header length [0-9]* is impossible for a file of 32 bytes" -- \
    "$BIN" "${PATHARGS[@]}"
grep -q 'root' "$T/stderr" && bad "shard-not-safetensors: the file's bytes are echoed: $(cat "$T/stderr")"
# "\u0000" in a name is refused, never cut short; a tensor listed twice in the index is ambiguous
rm -f "$T/paths/$S2" && mv "$T/blob-s2" "$T/paths/$S2"
sed 's|"diffusion_pytorch_model-00002-of-00002.safetensors"|"diffusion_pytorch_model-00002-of-00002.safetensors\\u0000/../.."|' \
    "$T/paths.index.keep" >"$IDX"
expect_error shard-name-nul 1 "string 'diffusion_pytorch_model-00002-of-00002.safetensors' continues past a NUL" -- \
    "$BIN" "${PATHARGS[@]}"
sed 's|"weight_map": {|"weight_map": {"x_embedder.weight": "diffusion_pytorch_model-00002-of-00002.safetensors", |' \
    "$T/paths.index.keep" >"$IDX"
expect_error listed-twice 1 "tensor 'x_embedder.weight' is listed twice in weight_map" -- \
    "$BIN" "${PATHARGS[@]}"
cp "$T/paths.index.keep" "$IDX"
# opening is bounded: a shard of 70,000 empty tensors is refused from a count over its header,
# before any parse tree is built (the limit is 65,536 per file; docs/errors.md)
mkdir -p "$T/many"
cp "$DATA/flux_tiny/config.json" "$T/many/"
write_st "$T/many/diffusion_pytorch_model.safetensors" "$(awk 'BEGIN { printf "{"; for (i = 0; i < 70000; i++)
    printf "%s\"t%d\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}", i ? "," : "", i; printf "}" }')" 0
expect_error too-many-tensors 1 "70000 tensor entries exceed the limit of 65536 per file" -- \
    "$BIN" inspect --checkpoint "$T/many"
# messages that used to mislead: a wrong-typed _class_name is not "missing"; a JSON error gives
# its line and column; an input dtype that cannot be read as numbers names the tensor
printf '{"_class_name": 5}' >"$T/esc/config.json"
expect_error class-name-type 1 "'_class_name' must be a string, not a number" -- \
    "$BIN" inspect --config "$T/esc/config.json"
printf '{\n  "_class_name": "FluxTransformer2DModel",\n  "num_layers": 1,,\n}\n' >"$T/esc/config.json"
expect_error json-position 1 "config.json: invalid JSON near line 3, column 20 (byte 64)" -- \
    "$BIN" inspect --config "$T/esc/config.json"
write_st "$T/i16.safetensors" '{"encoder_hidden_states":{"dtype":"F32","shape":[1,48,32],"data_offsets":[0,6144]},"hidden_states":{"dtype":"F32","shape":[1,16,4],"data_offsets":[6144,6400]},"img_ids":{"dtype":"F32","shape":[16,3],"data_offsets":[6400,6592]},"pooled_projections":{"dtype":"F32","shape":[1,32],"data_offsets":[6592,6720]},"timestep":{"dtype":"BOOL","shape":[1],"data_offsets":[6720,6721]},"txt_ids":{"dtype":"F32","shape":[48,3],"data_offsets":[6721,7297]}}' 7297
expect_error input-dtype 1 "inputs: tensor 'timestep' has dtype BOOL, expected a number" -- \
    "$BIN" run --checkpoint "$DATA/flux_tiny" --inputs "$T/i16.safetensors" --out "$T/out.safetensors"
# the cfg axis: classifier-free guidance's two branches at once (negative_ inputs with
# --guidance-scale) or, without guidance, the two halves of a batch. With the same inner layout
# cfg 2 gives the bits of cfg 1 (each branch's forward does the same arithmetic); a group that
# computes the wrong branch is caught by the exchange's tags; a layout or input that would leave a
# group idle, or a guidance scale without negatives (or the reverse), is refused in one line
"$BIN" inputs --checkpoint "$DATA/flux_tiny" --out "$T/neg.safetensors" --negative --batch 2 \
    --seed 4 >/dev/null
"$BIN" inputs --checkpoint "$DATA/flux_tiny" --out "$T/b3.safetensors" --batch 3 --seed 5 >/dev/null
for inner in "" "--tp 2" "--ulysses 2" "--ring 2"; do
    n=1; for k in $inner; do case $k in [0-9]*) n=$((n * k));; esac; done
    rm -f "$T/g1.safetensors" "$T/g2.safetensors"
    if timeout 300 "$MPIEXEC" -n $n "$BIN" run --checkpoint "$DATA/flux_tiny" --inputs \
            "$T/neg.safetensors" --out "$T/g1.safetensors" --steps 2 --guidance-scale 4 $inner \
            --quiet 2>"$T/stderr" &&
       timeout 300 "$MPIEXEC" -n $((2 * n)) "$BIN" run --checkpoint "$DATA/flux_tiny" --inputs \
            "$T/neg.safetensors" --out "$T/g2.safetensors" --steps 2 --guidance-scale 4 --cfg 2 \
            $inner --report "$T/g2.json" --quiet 2>>"$T/stderr" &&
       cmp -s "$T/g1.safetensors" "$T/g2.safetensors" &&
       tr -d ' \t\n' <"$T/g2.json" | grep -q '"cfg":2' &&
       ! tr -d ' \t\n' <"$T/g2.json" | grep -q '"cfg":0,"tp":0,"ring":0,"ulysses":0,"cp":0'; then ok
    else bad "guided cfg 2 $inner: not the bits of cfg 1: $(head -c 300 "$T/stderr")"; fi
done
# the guidance changes the result (a scale that did nothing would pass the comparison above)
"$BIN" run --checkpoint "$DATA/flux_tiny" --inputs "$T/neg.safetensors" --out "$T/g3.safetensors" \
    --steps 2 --guidance-scale 1.5 --quiet 2>/dev/null
if ! "$BIN" compare "$T/g3.safetensors" "$T/g1.safetensors" --tol 1e-3 >/dev/null; then ok
else bad "the guidance scale did not change the result"; fi
rm -f "$T/s1.safetensors" "$T/s2.safetensors"
if "$BIN" run --checkpoint "$DATA/flux_tiny" --inputs "$T/b3.safetensors" --out "$T/s1.safetensors" \
        --steps 2 --quiet && timeout 300 "$MPIEXEC" -n 2 "$BIN" run --checkpoint "$DATA/flux_tiny" \
        --inputs "$T/b3.safetensors" --out "$T/s2.safetensors" --steps 2 --cfg 2 --quiet &&
   "$BIN" compare "$T/s2.safetensors" "$T/s1.safetensors" --tol 1e-6 >/dev/null; then ok
else bad "a batch of 3 split by --cfg 2 differs from one rank"; fi
# a timestep and guidance of [1] are every sample's: each part of the split batch gets them whole
# (equal to one rank); a text of [1, ...] beside a batch of 2 is no such value and stays refused
"$ST_EDIT" "$DATA/flux_guidance/inputs.safetensors" "$T/shared.st" timestep@first guidance@first
rm -f "$T/s1.safetensors" "$T/s2.safetensors"
if "$BIN" run --checkpoint "$DATA/flux_guidance" --inputs "$T/shared.st" --out "$T/s1.safetensors" \
        --steps 2 --quiet && timeout 300 "$MPIEXEC" -n 2 "$BIN" run --checkpoint \
        "$DATA/flux_guidance" --inputs "$T/shared.st" --out "$T/s2.safetensors" --steps 2 --cfg 2 \
        --quiet 2>"$T/stderr" &&
   "$BIN" compare "$T/s2.safetensors" "$T/s1.safetensors" --tol 1e-6 >/dev/null; then ok
else bad "a [1] timestep and guidance, batch 2 split by --cfg 2: $(head -c 300 "$T/stderr")"; fi
"$ST_EDIT" "$T/shared.st" "$T/shared_txt.st" encoder_hidden_states@first
mpi_error cfg-split-batch 2 "'encoder_hidden_states' must have the batch 2 of 'hidden_states'" -- \
    run --checkpoint "$DATA/flux_guidance" --inputs "$T/shared_txt.st" --out "$T/out.safetensors" \
    --steps 2 --cfg 2
CFGARGS=(run --checkpoint "$DATA/flux_tiny" --out "$T/out.safetensors" --steps 2)
mpi_error cfg-idle 2 "a cfg group would idle" -- "${CFGARGS[@]}" --inputs \
    "$DATA/flux_tiny/inputs.safetensors" --cfg 2
mpi_error cfg-three 3 "--cfg must be an integer in \[1, 2\]" -- "${CFGARGS[@]}" --inputs "$DATA/flux_tiny/inputs.safetensors" --cfg 3
expect_error cfg-no-scale 1 "negative_ tensors need a guidance scale" -- "$BIN" "${CFGARGS[@]}" \
    --inputs "$T/neg.safetensors"
expect_error cfg-no-negatives 1 "--guidance-scale 3 needs the unconditional branch's inputs" \
    "encoder_hidden_states, pooled_projections, txt_ids" -- "$BIN" "${CFGARGS[@]}" --inputs \
    "$DATA/flux_tiny/inputs.safetensors" --guidance-scale 3
write_st "$T/negbad.safetensors" '{"encoder_hidden_states":{"dtype":"F32","shape":[1,48,32],"data_offsets":[0,6144]},"hidden_states":{"dtype":"F32","shape":[1,16,4],"data_offsets":[6144,6400]},"img_ids":{"dtype":"F32","shape":[16,3],"data_offsets":[6400,6592]},"pooled_projections":{"dtype":"F32","shape":[1,32],"data_offsets":[6592,6720]},"timestep":{"dtype":"F32","shape":[1],"data_offsets":[6720,6724]},"txt_ids":{"dtype":"F32","shape":[48,3],"data_offsets":[6724,7300]},"negative_encoder_hidden_states":{"dtype":"F32","shape":[1,48,31],"data_offsets":[7300,13252]},"negative_img_ids":{"dtype":"F32","shape":[16,3],"data_offsets":[13252,13444]}}' 13444
expect_error cfg-negative-shape 1 "'negative_encoder_hidden_states' has shape \[1, 48, 31\]" \
    "\[1, 48, 32\]" -- "$BIN" "${CFGARGS[@]}" --inputs "$T/negbad.safetensors" --guidance-scale 3
write_st "$T/negbad.safetensors" '{"encoder_hidden_states":{"dtype":"F32","shape":[1,48,32],"data_offsets":[0,6144]},"hidden_states":{"dtype":"F32","shape":[1,16,4],"data_offsets":[6144,6400]},"img_ids":{"dtype":"F32","shape":[16,3],"data_offsets":[6400,6592]},"pooled_projections":{"dtype":"F32","shape":[1,32],"data_offsets":[6592,6720]},"timestep":{"dtype":"F32","shape":[1],"data_offsets":[6720,6724]},"txt_ids":{"dtype":"F32","shape":[48,3],"data_offsets":[6724,7300]},"negative_img_ids":{"dtype":"F32","shape":[16,3],"data_offsets":[7300,7492]}}' 7492
expect_error cfg-negative-unknown 1 "'negative_img_ids': the unconditional branch" -- "$BIN" \
    "${CFGARGS[@]}" --inputs "$T/negbad.safetensors" --guidance-scale 3
export MESHDIT_TEST_CFG_SAME_BRANCH=1 # negative control: group 1 computes the conditional branch
mpi_error cfg-same-branch 2 "no silent degrade: cfg group 1 sent branch 0" -- "${CFGARGS[@]}" \
    --inputs "$T/neg.safetensors" --guidance-scale 3 --cfg 2
unset MESHDIT_TEST_CFG_SAME_BRANCH
# ---- LoRA adapters (--lora FILE[:SCALE], docs/lora.md) ----
L=$DATA/lora/flux_tiny
LRUN=(run --checkpoint "$DATA/flux_tiny" --inputs "$DATA/flux_tiny/inputs.safetensors" --quiet)
run_case "$DATA/flux_tiny" "$L/expected_a.safetensors" --lora "$L/a.safetensors"
run_case "$DATA/flux_tiny" "$L/expected_ab.safetensors" --lora "$L/a.safetensors:0.7" --lora "$L/b.safetensors:-1.3"
if [ -x "$MPIEXEC" ] || command -v "${MPIEXEC:-mpiexec}" >/dev/null; then
    if ${MPIEXEC:-mpiexec} -n 2 "$BIN" "${LRUN[@]}" --tp 2 --out "$T/lo2.safetensors" --lora "$L/a.safetensors:0.7" \
        --lora "$L/b.safetensors:-1.3" && "$BIN" compare "$T/lo2.safetensors" "$L/expected_ab.safetensors" --tol 1e-4 >/dev/null; then
        ok; else bad "--lora under tp=2"; fi
fi
# scale 0 is the base run, bit for bit; the report lists the adapters
if "$BIN" "${LRUN[@]}" --out "$T/l0.safetensors" --lora "$L/a.safetensors:0" --report "$T/l0.json" &&
   "$BIN" "${LRUN[@]}" --out "$T/lb.safetensors" && cmp -s "$T/l0.safetensors" "$T/lb.safetensors" &&
   grep -q '"adapters"' "$T/l0.json" && grep -q '"name":[[:space:]]*"a"' "$T/l0.json"; then
    ok; else bad "--lora FILE:0 is not the base run, or the report lacks the adapter"; fi
if "$BIN" run --checkpoint "$DATA/flux_tiny" --inputs "$DATA/flux_tiny/inputs.safetensors" \
    --out "$T/l1.safetensors" --lora "$L/a.safetensors" >"$T/lstdout" &&
   grep -q "adapter a (.*a.safetensors): scale 1, 28 linear weights, rank 2..4" "$T/lstdout"; then
    ok; else bad "run prints the adapter: $(cat "$T/lstdout")"; fi
if "$BIN" inspect --checkpoint "$DATA/flux_tiny" --tp 2 --lora "$L/b.safetensors" >"$T/linsp" &&
   grep -q "adapter .*b.safetensors: 6 linear weights" "$T/linsp" &&
   grep -Eq "transformer_blocks.0.attn.to_q.weight +colwise +2 +2.5 +\[2, 32\] +\[16, 2\] +\+bias" "$T/linsp"; then
    ok; else bad "inspect --lora: $(cat "$T/linsp" | tail -9)"; fi
# names from the files' base names, each unique: a, a again (a-2), and a file called a-2 (a-2-2)
mkdir -p "$T/ln/sub" && cp "$L/a.safetensors" "$T/ln/a.safetensors" &&
    cp "$L/a.safetensors" "$T/ln/sub/a.safetensors" && cp "$L/b.safetensors" "$T/ln/a-2.safetensors"
if "$BIN" "${LRUN[@]}" --out "$T/ln.safetensors" --report "$T/ln.json" --lora "$T/ln/a.safetensors:0" \
    --lora "$T/ln/sub/a.safetensors:0" --lora "$T/ln/a-2.safetensors:0" &&
   grep -q '"name":[[:space:]]*"a-2"' "$T/ln.json" && grep -q '"name":[[:space:]]*"a-2-2"' "$T/ln.json"; then
    ok; else bad "--lora names: a, sub/a and a-2 not loaded as a, a-2, a-2-2"; fi
expect_error lora-missing 1 "/nonexistent.safetensors" -- "$BIN" "${LRUN[@]}" --out "$T/out.safetensors" \
    --lora /nonexistent.safetensors
# a scale that is not a plain finite number is named as the scale, not as a missing file
for v in nan abc 1,5 " 1" 0x1; do
    expect_error "lora-scale-$v" 1 "the scale '$v' after the last ':' is not a finite decimal" -- \
        "$BIN" "${LRUN[@]}" --out "$T/out.safetensors" --lora "$L/a.safetensors:$v"
done
write_st "$T/lbad.safetensors" '{"transformer.nope.lora_A.weight":{"dtype":"F32","shape":[1,1],"data_offsets":[0,4]},"lora_unet_x.lora_down.weight":{"dtype":"F32","shape":[1,1],"data_offsets":[4,8]}}' 8
expect_error lora-unmapped 1 "2 keys map to no weight" "'lora_unet_x.lora_down.weight'" "'transformer.nope.lora_A.weight'" "kohya" -- \
    "$BIN" "${LRUN[@]}" --out "$T/out.safetensors" --lora "$T/lbad.safetensors:0.5"
expect_error lora-inspect 1 "2 keys map to no weight" -- "$BIN" inspect --checkpoint "$DATA/flux_tiny" --lora "$T/lbad.safetensors"
# an adapter that cannot be read is refused before the report: nothing printed on stdout
"$BIN" inspect --checkpoint "$DATA/flux_tiny" --lora /nonexistent.safetensors >"$T/linsp_bad" 2>/dev/null
[ $? = 1 ] && [ ! -s "$T/linsp_bad" ] && ok || bad "inspect --lora of a missing file printed $(wc -l <"$T/linsp_bad") lines first"
# step caching (--cache first_block): the decisions are every rank's, so every layout skips the
# same forwards as one rank and gives its result (<= 1e-5); the threshold makes some forwards skip
# and some compute; threshold 0 computes every block (the bits of no cache); the guided branches
# keep their own state, the same under cfg 2 as cfg 1
"$BIN" gen --model flux --preset tiny --seed 0 --out "$T/ctiny" >/dev/null
"$BIN" inputs --checkpoint "$T/ctiny" --seed 1 --img-tokens 64 --txt-tokens 16 \
    --out "$T/cin.safetensors" >/dev/null
CRUN=(run --checkpoint "$T/ctiny" --inputs "$T/cin.safetensors" --steps 10)
"$BIN" "${CRUN[@]}" --out "$T/c1.safetensors" --cache first_block:threshold=1.0 \
    --report "$T/c1.json" >"$T/c1.txt" 2>&1
"$BIN" "${CRUN[@]}" --out "$T/c0.safetensors" --quiet
cpat=$(grep -o '(C[-C]*;' "$T/c1.txt")
if grep -q 'forwards skipped blocks' "$T/c1.txt" && [[ $cpat == *-* ]] &&
   [[ ${cpat#(C} == *C* ]] && tr -d ' \t\n' <"$T/c1.json" | grep -q '"blocks_skipped":' &&
   ! "$BIN" compare "$T/c1.safetensors" "$T/c0.safetensors" --tol 1e-3 >/dev/null; then ok
else bad "--cache: no mixed skip pattern, or no effect: $(head -c 300 "$T/c1.txt")"; fi
for lay in "2 --ring 2" "4 --tp 2 --ulysses 2" "4 --ring 2 --ulysses 2"; do
    set -- $lay
    n=$1; shift
    if timeout 300 "$MPIEXEC" -n "$n" "$BIN" "${CRUN[@]}" --out "$T/cl.safetensors" "$@" \
            --cache first_block:threshold=1.0 >"$T/cl.txt" 2>&1 &&
       [ "$(grep -o '(C[-C]*;' "$T/cl.txt")" = "$cpat" ] &&
       "$BIN" compare "$T/cl.safetensors" "$T/c1.safetensors" --tol 1e-5 >/dev/null; then ok
    else bad "--cache on $lay: not one rank's skips or result: $(head -c 300 "$T/cl.txt")"; fi
done
"$BIN" "${CRUN[@]}" --out "$T/cz.safetensors" --cache first_block:threshold=0 --quiet
if cmp -s "$T/cz.safetensors" "$T/c0.safetensors"; then ok
else bad "--cache threshold 0 is not the uncached result"; fi
"$BIN" inputs --checkpoint "$T/ctiny" --seed 2 --img-tokens 64 --txt-tokens 16 --negative \
    --out "$T/cneg.safetensors" >/dev/null
GRUN=(run --checkpoint "$T/ctiny" --inputs "$T/cneg.safetensors" --steps 10 --guidance-scale 3
      --cache first_block:threshold=1.0)
if "$BIN" "${GRUN[@]}" --out "$T/cg1.safetensors" --report "$T/cg1.json" >"$T/cg1.txt" 2>&1 &&
   timeout 300 "$MPIEXEC" -n 2 "$BIN" "${GRUN[@]}" --cfg 2 --out "$T/cg2.safetensors" \
       --quiet 2>"$T/stderr" && cmp -s "$T/cg1.safetensors" "$T/cg2.safetensors" &&
   tr -d ' \t\n' <"$T/cg1.json" | grep -q '"branch":"uncond","skipped":true' &&
   tr -d ' \t\n' <"$T/cg1.json" | grep -q '"branch":"cond","skipped":false'; then ok
else bad "--cache with guidance: cfg 2 not the bits of cfg 1: $(head -c 300 "$T/cg1.txt" "$T/stderr")"; fi
sb() { tr -d ' \t\n' <"$1" | grep -o '"state_bytes":[0-9]*' | cut -d: -f2; }
# MagCache: the decisions come from the ratio schedule (FLUX_MAG_RATIOS' first values here), the
# same on every layout; a skip skips every block
MAG="mag:threshold=0.1,num_inference_steps=10,retention_ratio=0.2,max_skip_steps=3,mag_ratios=1.0/1.21094/1.11719/1.07812/1.0625/1.03906/1.03125/1.03906/1.02344/1.03125"
"$BIN" "${CRUN[@]}" --out "$T/m1.safetensors" --cache "$MAG" --report "$T/m1.json" >"$T/m1.txt" 2>&1
mpat=$(grep -o '(C[-C]*;' "$T/m1.txt")
if [[ $mpat == *-* ]] && [[ ${mpat#(CC} == *C* ]] &&
   tr -d ' \t\n' <"$T/m1.json" | grep -q '"skipped":true,"diff":[0-9.e-]*,"blocks_computed":0' &&
   ! "$BIN" compare "$T/m1.safetensors" "$T/c0.safetensors" --tol 1e-3 >/dev/null &&
   timeout 300 "$MPIEXEC" -n 4 "$BIN" "${CRUN[@]}" --out "$T/ml.safetensors" --tp 2 --ring 2 \
       --cache "$MAG" >"$T/ml.txt" 2>&1 && [ "$(grep -o '(C[-C]*;' "$T/ml.txt")" = "$mpat" ] &&
   "$BIN" compare "$T/ml.safetensors" "$T/m1.safetensors" --tol 1e-5 >/dev/null; then ok
else bad "--cache mag: $(head -c 300 "$T/m1.txt" "$T/ml.txt")"; fi
# a retention ratio past the schedule, however large, skips nothing (diffusers: int(ratio * steps
# + 0.5) is past the last step); the report's state bytes are what the run held (the residual,
# let go at the schedule's end)
"$BIN" "${CRUN[@]}" --out "$T/m2.safetensors" --cache "${MAG/retention_ratio=0.2/retention_ratio=1e300}" \
    >"$T/m2.txt" 2>&1
if [ "$(grep -o '(C[-C]*;' "$T/m2.txt")" = "(CCCCCCCCCC;" ] &&
   [ "$(sb "$T/m1.json")" -gt 0 ]; then ok
else bad "--cache mag, retention 1e300 or state bytes: $(head -c 300 "$T/m2.txt") $(sb "$T/m1.json")"; fi
# TaylorSeer: attention outputs predicted between full steps, on Flux and Qwen-Image; every
# layout gives one rank's result; Wan is refused by name (diffusers' default patterns hook none of
# its attention modules)
TS=taylorseer:cache_interval=3,disable_cache_before_step=2,taylor_factors_dtype=float32
"$BIN" "${CRUN[@]}" --out "$T/t1.safetensors" --cache "$TS" >"$T/t1.txt" 2>&1
tpat=$(grep -o '(C[-C]*;' "$T/t1.txt")
if [ "$tpat" = "(CC-C--C--C;" ] &&
   ! "$BIN" compare "$T/t1.safetensors" "$T/c0.safetensors" --tol 1e-4 >/dev/null &&
   timeout 300 "$MPIEXEC" -n 4 "$BIN" "${CRUN[@]}" --out "$T/tl.safetensors" --ring 2 \
       --ulysses 2 --cache "$TS" >"$T/tl.txt" 2>&1 &&
   "$BIN" compare "$T/tl.safetensors" "$T/t1.safetensors" --tol 1e-5 >/dev/null; then ok
else bad "--cache taylorseer: $(head -c 300 "$T/t1.txt" "$T/tl.txt")"; fi
# the report's state bytes: the factors are TaylorSeer's whole state, in half the bytes in bf16
# (diffusers' default) than in f32, and the bf16 run's result is its own (the rounding shows)
"$BIN" "${CRUN[@]}" --out "$T/t2.safetensors" --cache "${TS%float32}bfloat16" \
    --report "$T/t2.json" >/dev/null 2>&1
"$BIN" "${CRUN[@]}" --out "$T/t3.safetensors" --cache "$TS" --report "$T/t3.json" >/dev/null 2>&1
b2=$(sb "$T/t2.json") b3=$(sb "$T/t3.json")
# the report's spec is a spec: fed back, it runs the same generation (no cooldown reads "none")
rspec=$(tr -d '\n' <"$T/t3.json" | grep -o '"spec":[[:space:]]*"taylorseer:[^"]*"' | sed 's/.*"\(taylorseer:[^"]*\)"/\1/')
if [[ $rspec == *disable_cache_after_step=none* ]] &&
   "$BIN" "${CRUN[@]}" --out "$T/t4.safetensors" --cache "$rspec" >/dev/null 2>&1 &&
   cmp -s "$T/t4.safetensors" "$T/t3.safetensors"; then ok
else bad "taylorseer: the report's spec '$rspec' does not read back"; fi
if [ -n "$b2" ] && [ "$b2" -gt 0 ] && [ $((2 * b2)) = "$b3" ] &&
   ! "$BIN" compare "$T/t2.safetensors" "$T/t3.safetensors" --tol 1e-7 >/dev/null; then ok
else bad "taylorseer state bytes: bf16 $b2, f32 $b3"; fi
"$BIN" gen --model qwenimage --preset tiny --seed 0 --out "$T/cq" >/dev/null
"$BIN" inputs --checkpoint "$T/cq" --seed 1 --out "$T/cqin.safetensors" >/dev/null
QRUN=(run --checkpoint "$T/cq" --inputs "$T/cqin.safetensors" --steps 8 --cache "$TS")
if "$BIN" "${QRUN[@]}" --out "$T/q1.safetensors" --quiet 2>"$T/stderr" &&
   timeout 300 "$MPIEXEC" -n 4 "$BIN" "${QRUN[@]}" --out "$T/ql.safetensors" --tp 2 --ulysses 2 \
       --quiet 2>>"$T/stderr" &&
   "$BIN" compare "$T/ql.safetensors" "$T/q1.safetensors" --tol 1e-5 >/dev/null; then ok
else bad "--cache taylorseer on Qwen-Image, tp2 x ulysses2: $(head -c 300 "$T/stderr")"; fi
"$BIN" gen --model wan --preset tiny --seed 0 --out "$T/cw" >/dev/null
"$BIN" inputs --checkpoint "$T/cw" --seed 1 --out "$T/cwin.safetensors" >/dev/null
# text_kv: Wan's cross-attention K/V kept from each branch's first forward: exact (the uncached
# bits, guided, on one rank and tp2 x ring2); a family without cross-attention refuses it
"$BIN" inputs --checkpoint "$T/cw" --seed 2 --negative --out "$T/cwneg.safetensors" >/dev/null
KRUN=(run --checkpoint "$T/cw" --inputs "$T/cwneg.safetensors" --steps 4 --guidance-scale 3)
kv_ok=1
for lay in "1" "4 --tp 2 --ring 2"; do
    set -- $lay
    n=$1; shift
    timeout 300 "$MPIEXEC" -n "$n" "$BIN" "${KRUN[@]}" "$@" --out "$T/ku.safetensors" --quiet &&
    timeout 300 "$MPIEXEC" -n "$n" "$BIN" "${KRUN[@]}" "$@" --out "$T/kc.safetensors" \
        --cache text_kv >"$T/kc.txt" 2>&1 &&
    grep -q '(CC------;' "$T/kc.txt" && cmp -s "$T/ku.safetensors" "$T/kc.safetensors" || kv_ok=0
done
if [ $kv_ok = 1 ]; then ok; else bad "--cache text_kv: not the uncached bits: $(head -c 300 "$T/kc.txt")"; fi
expect_error cache-kv-flux 1 "text_kv is not implemented for FluxTransformer2DModel" -- \
    "$BIN" "${CRUN[@]}" --out "$T/out.safetensors" --cache text_kv
expect_error cache-taylor-wan 1 "taylorseer is not implemented for WanTransformer3DModel" -- \
    "$BIN" run --checkpoint "$T/cw" --inputs "$T/cwin.safetensors" --steps 4 \
    --out "$T/out.safetensors" --cache "$TS"
# diffusers compares disable_cache_after_step as given: -1 is a cooldown from the first step
# (every step computed: the uncached bits), not "never"
"$BIN" "${CRUN[@]}" --out "$T/t5.safetensors" --cache taylorseer:disable_cache_after_step=-1 \
    >"$T/t5.txt" 2>&1
if [ "$(grep -o '(C[-C]*;' "$T/t5.txt")" = "(CCCCCCCCCC;" ] &&
   cmp -s "$T/t5.safetensors" "$T/c0.safetensors"; then ok
else bad "taylorseer disable_cache_after_step=-1: $(head -c 300 "$T/t5.txt")"; fi
expect_error cache-taylor-step0 1 "would predict step 0" -- "$BIN" "${CRUN[@]}" \
    --out "$T/out.safetensors" --cache taylorseer:disable_cache_before_step=0
expect_error cache-mag-ratios 2 "mag needs mag_ratios" -- "$BIN" "${CRUN[@]}" \
    --out "$T/out.safetensors" --cache mag:threshold=0.1
expect_error cache-mag-key 2 "mag has no key 'calibrate'" -- "$BIN" "${CRUN[@]}" \
    --out "$T/out.safetensors" --cache mag:mag_ratios=1.0,calibrate=1
expect_error cache-no-steps 2 "--cache" "--steps" -- "$BIN" run --checkpoint "$T/ctiny" \
    --inputs "$T/cin.safetensors" --out "$T/out.safetensors" --cache first_block
expect_error cache-unknown 2 "unknown cache 'pab'" -- "$BIN" "${CRUN[@]}" \
    --out "$T/out.safetensors" --cache pab
expect_error cache-key 2 "first_block has no key 'tresh'" -- "$BIN" "${CRUN[@]}" \
    --out "$T/out.safetensors" --cache first_block:tresh=0.1
expect_error cache-value 2 "threshold=-1 is not a number >= 0" -- "$BIN" "${CRUN[@]}" \
    --out "$T/out.safetensors" --cache first_block:threshold=-1
# a spec reads one way only: no key twice, no empty item, plain decimal numbers, no keys where
# the cache takes none, no empty spec; a flag given twice or glued to its value is named
expect_error cache-twice 2 "key 'threshold' is given twice" -- "$BIN" "${CRUN[@]}" \
    --out "$T/out.safetensors" --cache first_block:threshold=0.05,threshold=0.1
expect_error cache-empty-item 2 "an empty item" -- "$BIN" "${CRUN[@]}" \
    --out "$T/out.safetensors" --cache first_block:threshold=0.5,,
for v in 0x10 " 0.05" +1 inf 1e; do
    expect_error "cache-number-$v" 2 "is not a number" -- "$BIN" "${CRUN[@]}" \
        --out "$T/out.safetensors" --cache "first_block:threshold=$v"
done
expect_error cache-int 2 "max_order= 1 is not an integer" -- "$BIN" "${CRUN[@]}" \
    --out "$T/out.safetensors" --cache "taylorseer:max_order= 1"
expect_error cache-kv-keys 2 "text_kv takes no keys (got 'threshold')" -- "$BIN" "${CRUN[@]}" \
    --out "$T/out.safetensors" --cache text_kv:threshold=0.5
expect_error cache-empty 2 "cache spec: empty" -- "$BIN" "${CRUN[@]}" \
    --out "$T/out.safetensors" --cache ""
expect_error cache-flag-twice 2 "option --cache is given more than once" -- "$BIN" "${CRUN[@]}" \
    --out "$T/out.safetensors" --cache first_block --cache first_block:threshold=1
expect_error cache-flag-eq 2 "write the value after a space (--cache first_block)" -- \
    "$BIN" "${CRUN[@]}" --out "$T/out.safetensors" --cache=first_block
"$BIN" gen --model flux2 --preset tiny --seed 0 --out "$T/c2tiny" >/dev/null
"$BIN" inputs --checkpoint "$T/c2tiny" --seed 1 --out "$T/c2in.safetensors" >/dev/null
expect_error cache-family 1 "first_block is not implemented for Flux2Transformer2DModel" -- \
    "$BIN" run --checkpoint "$T/c2tiny" --inputs "$T/c2in.safetensors" --steps 2 \
    --out "$T/out.safetensors" --cache first_block
"$BIN" inputs --checkpoint "$T/ctiny" --seed 1 --batch 2 --out "$T/cb2.safetensors" >/dev/null
mpi_error cache-cfg-split 2 "each cfg group would decide on its half" -- run --checkpoint \
    "$T/ctiny" --inputs "$T/cb2.safetensors" --out "$T/out.safetensors" --steps 2 --cfg 2 \
    --cache first_block
echo "test_cli.sh: $pass passed, $fail failed"
[ "$fail" = 0 ]
