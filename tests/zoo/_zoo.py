"""Small transformers models with random weights (nothing downloaded) for the
model-zoo tests: reduced widths and depths, batch 2."""
import torch
import transformers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    MobileNetV2Config,
    MobileNetV2ForImageClassification,
    ResNetConfig,
    ResNetForImageClassification,
)

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

VOCAB = 64
CNNS = ("resnet-basic", "resnet-bottleneck", "mobilenet_v2")


def cnn(kind: str, seed: int = 0):
    """``(model, input)``: an image classifier (5 classes) in eval mode and a batch of 2 images."""
    torch.manual_seed(seed)
    if kind == "resnet-basic":
        cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                           num_labels=5)
        model, size = ResNetForImageClassification(cfg), 16
    elif kind == "resnet-bottleneck":
        cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[16, 32], depths=[1, 1],
                           layer_type="bottleneck", num_labels=5)
        model, size = ResNetForImageClassification(cfg), 16
    elif kind == "mobilenet_v2":  # depthwise convs, stride 2, inverted residuals, TF-style padding
        cfg = MobileNetV2Config(num_channels=3, image_size=32, depth_multiplier=0.25, num_labels=5,
                                classifier_dropout_prob=0.0)
        model, size = MobileNetV2ForImageClassification(cfg), 32
    else:
        raise ValueError(kind)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # BatchNorm statistics and affine parts that are not the identity
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1, generator=g)
                m.running_var.uniform_(0.5, 1.5, generator=g)
                m.weight.uniform_(0.5, 1.5, generator=g)
                m.bias.normal_(0, 0.1, generator=g)
    return model.eval(), torch.randn(2, 3, size, size, generator=g)


def labels(n: int = 2, classes: int = 5, seed: int = 0):
    return torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(seed))


def gpt2(seed: int = 0):
    torch.manual_seed(seed)
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def bert(seed: int = 0):
    torch.manual_seed(seed)
    cfg = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     vocab_size=VOCAB, max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg)


def tokens(n: int = 2, length: int = 8, seed: int = 0):
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def logits(out):
    return out if isinstance(out, torch.Tensor) else out.logits
