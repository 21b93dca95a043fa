"""Triton kernels, their launchers and pure-torch references (installed as `tplayers.kernels`).

Nothing here imports torch.distributed. Importing a kernel module imports triton, so the
module layer imports these lazily: `import tplayers` works without triton or a GPU.
"""
