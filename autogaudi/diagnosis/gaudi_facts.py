"""The Gaudi facts the doctor judges by, each with where it comes from. Update them together with
``SOURCES`` when Intel's documentation changes; ``RETRIEVED`` says when they were last read.

Deliberately small: only what the pages state. The per-operator support table of the PyTorch
Operators page is not copied here (too large to keep faithful by hand); what is known to be
unsupported are whole data types, from the Support Matrix.
"""

RETRIEVED = "2026-11-22"
SOURCES = {
    "support_matrix": "https://docs.habana.ai/en/latest/PyTorch/Reference/PyTorch_Support_Matrix.html",
    "autocast": "https://docs.habana.ai/en/latest/PyTorch/PyTorch_Mixed_Precision/Autocast.html",
    "dynamic_shapes": "https://developer.habana.ai/tutorials/pytorch/detecting-dynamic-shapes/",
    "theory_of_operations": "https://docs.habana.ai/en/latest/PyTorch/Reference/PyTorch_Gaudi_Theory_of_Operations.html",
    "performance_guide": "shared/docs/hpu-api.md (Gaudi software 1.19 / optimum-habana 1.21 summary)",
}
SOFTWARE_VERSION = "Intel Gaudi software documentation 'latest' as retrieved; bridge API as of 1.19"

# Support Matrix, "Data Types": Float64, Complex32, Complex64 and the quantized types: "No".
UNSUPPORTED_DTYPES = ("float64", "complex64", "complex128")

# Autocast page, "Registered Operators": the ops Gaudi's torch.autocast runs in bfloat16 by default
# ("Lower precision") and the ones it keeps in float32 (the FP32 list, as far as it was retrieved).
AUTOCAST_BF16_OPS = frozenset(
    {
        "addmm",
        "addbmm",
        "batch_norm",
        "baddbmm",
        "bmm",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "dot",
        "dropout",
        "feature_dropout",
        "group_norm",
        "instance_norm",
        "layer_norm",
        "leaky_relu",
        "linear",
        "matmul",
        "mean",
        "mm",
        "mul",
        "mv",
        "softmax",
        "log_softmax",
        "scaled_dot_product_attention",
    }
)
AUTOCAST_FP32_OPS = frozenset(
    {
        "acos",
        "addcdiv",
        "asin",
        "atan2",
        "bilinear",
        "binary_cross_entropy",
        "binary_cross_entropy_with_logits",
        "cdist",
        "cosh",
        "cosine_embedding_loss",
        "cosine_similarity",
        "cross_entropy_loss",
        "dist",
        "div",
        "divide",
        "embedding",
        "embedding_bag",
        "erfinv",
        "exp",
        "expm1",
        "hinge_embedding_loss",
        "huber_loss",
        "kl_div",
        "l1_loss",
        "log",
        "log10",
        "log1p",
        "log2",
        "logsumexp",
        "margin_ranking_loss",
        "mse_loss",
        "multi_margin_loss",
        "multilabel_margin_loss",
        "nll_loss",
        "pdist",
        "poisson_nll_loss",
        "pow",
        "reciprocal",
        "renorm",
        "rsqrt",
        "sinh",
        "smooth_l1_loss",
        "soft_margin_loss",
        "softplus",
        "tan",
        "topk",
        "triplet_margin_loss",
        "truediv",
    }
)
# The aten ops a dispatch mode sees for the autocast names above (composite ops are decomposed).
ATEN_ALIASES = {
    "convolution": "conv2d",
    "_convolution": "conv2d",
    "native_batch_norm": "batch_norm",
    "_native_batch_norm_legit": "batch_norm",
    "_native_batch_norm_legit_functional": "batch_norm",
    "native_layer_norm": "layer_norm",
    "native_group_norm": "group_norm",
    "_softmax": "softmax",
    "_log_softmax": "log_softmax",
    "native_dropout": "dropout",
    "nll_loss_forward": "nll_loss",
    "nll_loss2d_forward": "nll_loss",
    "_scaled_dot_product_flash_attention_for_cpu": "scaled_dot_product_attention",
    "_scaled_dot_product_efficient_attention": "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention": "scaled_dot_product_attention",
}

# Matrix-engine tiles: sizes that are multiples of these keep the MME fully used (the issue's
# reading of the performance guide: batch sizes in multiples of 8; large matrix dimensions in
# multiples of 64 for bf16). "Large" here: 512 or more.
BATCH_MULTIPLE = 8
MATRIX_MULTIPLE = 64
LARGE_DIMENSION = 512
