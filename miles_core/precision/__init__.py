"""Low-precision formats as one contract (issue: low-precision rollouts and training): each
format's quantizer is a plain function of a float tensor, the same for checkpoint conversion,
training, rollout and live weight export. `fp8.py`: FP8 E4M3 with fp32 scales, per tensor and
in 128×128 blocks; `e8m0.py`: power-of-two E8M0 scales (RCEIL and FLOOR, in integer bit
operations); `fp4.py`: E2M1 elements and their packing; `mx.py`: MXFP8 and MXFP4, 1×32 blocks
with E8M0 scales."""
