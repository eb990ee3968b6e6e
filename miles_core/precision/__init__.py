"""Low-precision formats as one contract (`rollout.precision`, docs/precision.md): each
format's quantizer is a plain function of a float tensor, the same for checkpoint conversion,
training, rollout and live weight export.

Quantizers: `fp8.py` (E4M3 with float32 scales, per tensor and in 128×128 blocks), `e8m0.py`
(power-of-two scales, RCEIL and FLOOR in integer bit operations), `fp4.py` (E2M1 elements and
their packing), `mx.py` (MXFP8, MXFP4), `nvfp4.py` (TransformerEngine's reference), `int4.py`
(group-wise symmetric, compressed-tensors packing), `blocks.py` (the blocks they scale over).

Around them: `format.py` (a format as a plug-in, `formats/`: its checkpoint tensors and
config, and the straight-through `fake_quantize`), `keep.py` (`precision.keep_bf16`),
`plan.py` (format + keep-list over a model's tensors), `served.py` (what an engine holds),
`push.py` (quantized pushes), `shards.py` (p2p: each rank its rows), `qat.py` (the
trainer's forward), `convert.py` (`miles convert`)."""
