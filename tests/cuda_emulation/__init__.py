"""spectral_ops._C's kernels compiled as C++ and run on the CPU: the execution model (threads, barriers,
shared memory, WMMA) is emulated, so the real kernel sources can be tested without a GPU."""
