"""Kernels of the engine's own, where torch's leave the machine's speed unused.

    cpu     small-batch linear layers on the CPU at memory speed on every intra-op thread
            (rows_linear.cpp), and a decode step's small ops one call each (decode_ops.cpp),
            built once per torch version by torch.utils.cpp_extension
"""
