from habana_frameworks.torch.hpex import kernels, normalization, optimizers  # noqa: F401
