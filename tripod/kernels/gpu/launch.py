"""The GPU kernels' launchers, one import for the backend (``tripod.kernels.gpu.ops()``)."""

from tripod.kernels.gpu.attention import keys_per_step, paged_attention, query_blocks, tile
from tripod.kernels.gpu.elementwise import rms_norm, rope_store_kv, silu_mul
from tripod.kernels.gpu.masks import apply_bitmask
from tripod.kernels.gpu.mla import mla_decode
from tripod.kernels.gpu.recurrent import conv_update, gated_delta, item_table, ssd_scan
from tripod.kernels.gpu.w4a16 import PackedW4, from_group_blocks, pack_w4, w4a16_linear
from tripod.kernels.gpu.w8a8 import int8_product
from tripod.kernels.gpu.w8a16 import PackedW8, from_q8_blocks, from_q8_halves, w8a16_linear

__all__ = ["PackedW4", "PackedW8", "apply_bitmask", "conv_update", "from_group_blocks", "from_q8_blocks", "from_q8_halves", "gated_delta", "int8_product", "item_table", "keys_per_step", "mla_decode", "pack_w4", "paged_attention", "query_blocks",
           "rms_norm", "rope_store_kv", "silu_mul", "ssd_scan", "tile", "w4a16_linear", "w8a16_linear"]
