"""Kernels of the engine's own, where torch's leave the machine's speed unused.

    cpu     small-batch linear layers on the CPU at memory speed on every intra-op thread
            (rows_linear.cpp, built once per torch version by torch.utils.cpp_extension)
"""
