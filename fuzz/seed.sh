#!/usr/bin/env bash
# Writes real plans into fuzz/corpus/decode_validate/ (the fuzzer's seed corpus), with the
# CLI of this checkout: `fuzz/seed.sh [path/to/specplan]` (default: a debug build).
set -euo pipefail
cd "$(dirname "$0")/.."
sp="${1:-target/debug/specplan}"
[ -x "$sp" ] || .ci/with-nvrtc cargo build -p specplan-cli
out=fuzz/corpus/decode_validate
mkdir -p "$out"
c() { local name="$1"; shift; .ci/with-nvrtc "$sp" compile "$@" -o "$out/$name.plan" >/dev/null; }
# Without kernel binaries: small inputs, so the fuzzer runs fast over every rule.
c tiny --preset tiny --no-kernels
c tiny-swa16-hot256 --preset tiny --sliding-window 16 --hot-vocab-size 256 --no-kernels
c tiny-fp16-page1 --preset tiny --dtype fp16 --page-size 1 --no-kernels
c tiny-n24 --preset tiny --speculative-num-draft-tokens 24 --no-kernels
c tiny-page16 --preset tiny --page-size 16 --max-requests 16 --no-kernels
c llama2-b12 --preset llama2-7b-eagle --buckets 1,2 --no-kernels
c wide-heads-d256 --hf-config tests/corpus/valid/wide-heads-d256.json --speculative-eagle-topk 4 \
  --speculative-num-steps 3 --speculative-num-draft-tokens 8 --buckets 1,3 --max-context-len 4096 --no-kernels
c tiny-eagle3 --hf-config tests/corpus/valid/tiny-eagle3.json --speculative-eagle-topk 4 \
  --speculative-num-steps 3 --speculative-num-draft-tokens 4 --buckets 1,2 --max-context-len 512 --no-kernels
# Draft decode: a chain with three tiers and a tree over pages.
c tiny-decode-chain --preset tiny --speculative-eagle-topk 1 --speculative-num-steps 3 \
  --speculative-num-draft-tokens 4 --draft-decode-steps 2,3,5 --buckets 1,2 --no-kernels
c tiny-decode-tree --preset tiny --draft-decode-steps auto --draft-decode-outputs tree,verify --buckets 1,2 --no-kernels
# Tensor-parallel ranks: shards, collectives, the cross-rank top-K and logits, the
# vocabulary-split embedding.
c tiny-tp2-r1 --preset tiny --tp-size 2 --tp-rank 1 --outputs topk,logits --buckets 1,2 --no-kernels
c tiny-eagle3-tp2-r0 --hf-config tests/corpus/valid/tiny-eagle3.json --speculative-eagle-topk 4 \
  --speculative-num-steps 3 --speculative-num-draft-tokens 4 --buckets 1,2 --max-context-len 512 \
  --tp-size 2 --tp-rank 0 --tp-embedding vocab --draft-decode-steps auto --no-kernels
# One with binaries (the CUBIN and PTX rules).
c tiny-kernels --preset tiny --buckets 1
ls -l "$out"
