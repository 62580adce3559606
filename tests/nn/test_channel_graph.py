"""Channel removal from the traced graph (prunopt.nn.channel_graph): the
channel groups that residual additions, concatenations, depthwise convolutions,
products and flatten create, and clear errors where the analysis cannot follow."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prunopt.nn import SparseBatchNorm2d, convert_to_sparse_batchnorm, remove_channels
from prunopt.nn.channel_graph import ChannelGraph, ChannelGraphError
from prunopt.pruning import Masker


def _randomise(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SparseBatchNorm2d):
                m.gate.alpha.uniform_(0.2, 1.0, generator=g)
                m.shift.normal_(generator=g)
                m.running_mean.normal_(generator=g)
                m.running_var.uniform_(0.5, 2, generator=g)
    return model


def _zero(bn, channels):
    with torch.no_grad():
        bn.gate.alpha[list(channels)] = 0.0


def _sbn(model, seed=0):
    torch.manual_seed(seed)
    return _randomise(convert_to_sparse_batchnorm(model, preserve=False), seed).eval()


def _convs(model):
    return {n: (m.in_channels, m.out_channels, m.groups) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}


class DenseCat(nn.Module):
    """DenseNet-style: the block's input concatenated with its output."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU())
        self.grow = nn.Sequential(nn.Conv2d(4, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3), nn.ReLU())
        self.head = nn.Conv2d(7, 5, 1)

    def forward(self, x):
        x = self.stem(x)
        return self.head(torch.cat([x, self.grow(x)], dim=1)).mean((2, 3))


@pytest.mark.parametrize("traced", ["fx", "fx+shapes"])
def test_concatenation_maps_channels_to_offsets(traced):
    model = _sbn(DenseCat())
    _zero(model.stem[1], [1])  # stem channel 1: read by grow's conv and, at offset 1, by head
    _zero(model.grow[1], [0, 2])  # grow channels 0, 2: offsets 4 and 6 of the concatenation
    x = torch.randn(3, 2, 6, 6)
    small = remove_channels(model, example_input=x if traced == "fx+shapes" else None)
    assert _convs(small) == {"stem.0": (2, 3, 1), "grow.0": (3, 1, 1), "head": (4, 5, 1)}
    torch.testing.assert_close(small(x), model(x), atol=1e-5, rtol=1e-5)


class InvertedResidual(nn.Module):
    """MobileNetV2's block: expand 1x1, depthwise 3x3, project 1x1, residual add."""

    def __init__(self, c=4, e=8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(2, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))
        self.expand = nn.Sequential(nn.Conv2d(c, e, 1, bias=False), nn.BatchNorm2d(e), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv2d(e, e, 3, padding=1, groups=e, bias=False), nn.BatchNorm2d(e), nn.ReLU6())
        self.project = nn.Sequential(nn.Conv2d(e, c, 1, bias=False), nn.BatchNorm2d(c))
        self.fc = nn.Linear(c, 3)

    def forward(self, x):
        x = self.stem(x)
        x = x + self.project(self.dw(self.expand(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def test_depthwise_convolution_joins_its_input_and_output_channels():
    model = _sbn(InvertedResidual())
    _zero(model.dw[1], [1, 5])  # after the depthwise conv: expand, dw and project lose 1 and 5
    _zero(model.expand[1], [3])  # before it: dw's BN turns the zero into its shift, so channel 3 stays
    _zero(model.stem[1], [2])  # the residual stream: project still adds into channel 2, so it stays
    _zero(model.stem[1], [0])
    _zero(model.project[1], [0])  # both branches zero in channel 0: removed from the stream
    x = torch.randn(2, 2, 5, 5)
    small = remove_channels(model, example_input=x)
    assert _convs(small) == {"stem.0": (2, 3, 1), "expand.0": (3, 6, 1), "dw.0": (6, 6, 6), "project.0": (6, 3, 1)}
    assert small.fc.in_features == 3
    torch.testing.assert_close(small(x), model(x), atol=1e-5, rtol=1e-5)


class SqueezeExcite(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(2, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU())
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(6, 2, 1), nn.ReLU(), nn.Conv2d(2, 6, 1),
                                nn.Sigmoid())
        self.out = nn.Conv2d(6, 4, 1)

    def forward(self, x):
        x = self.conv(x)
        return self.out(x * self.se(x))


def test_a_product_joins_the_excitation_with_the_feature_map():
    model = _sbn(SqueezeExcite())
    _zero(model.conv[1], [1, 4])
    x = torch.randn(2, 2, 5, 5)
    small = remove_channels(model, example_input=x)
    # the zero channels go from the feature map, the squeeze's input and the excitation's output alike
    assert _convs(small) == {"conv.0": (2, 4, 1), "se.1": (4, 2, 1), "se.3": (2, 4, 1), "out": (4, 4, 1)}
    torch.testing.assert_close(small(x), model(x), atol=1e-5, rtol=1e-5)


class VGGHead(nn.Module):
    """A classifier on the flattened 3x3 feature map (no global pooling)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                                      nn.MaxPool2d(2))
        self.fc = nn.Linear(4 * 3 * 3, 2)

    def forward(self, x):
        return self.fc(self.features(x).view(x.shape[0], -1))


def test_flatten_of_a_spatial_map_removes_blocks_of_features():
    model = _sbn(VGGHead())
    _zero(model.features[1], [0, 2])
    x = torch.randn(2, 1, 6, 6)
    small = remove_channels(model, example_input=x)
    assert small.features[0].out_channels == 2 and small.fc.in_features == 2 * 9
    torch.testing.assert_close(small.fc.weight, model.fc.weight.view(2, 4, 9)[:, [1, 3]].reshape(2, 18))
    torch.testing.assert_close(small(x), model(x), atol=1e-5, rtol=1e-5)
    # without an example input the spatial size is unknown: the flatten is a clear error, not a guess
    with pytest.raises(ChannelGraphError, match="view"):
        remove_channels(model)


class Unknown(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4))
        self.mix = Mixer()
        self.out = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.out(self.mix(self.conv(x)))


class Mixer(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=1)  # mixes the channels


def test_an_op_the_analysis_cannot_follow_is_an_error_naming_its_module():
    model = _sbn(Unknown())
    x = torch.randn(2, 1, 4, 4)
    torch.testing.assert_close(remove_channels(model, example_input=x)(x), model(x))  # no zero gate: fine
    _zero(model.conv[1], [1])
    with pytest.raises(ChannelGraphError, match="softmax in module 'mix'"):
        remove_channels(model, example_input=x)


class TokenMLP(nn.Module):
    """A sequence model: token embeddings (B, L, C), a layer norm (an operation
    the analysis does not follow, whose dim 1 is the sequence), then an MLP
    over the features, the last dimension."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.norm = nn.LayerNorm(6)
        self.up = nn.Linear(6, 8)
        self.down = nn.Linear(8, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, ids):
        h = self.norm(self.emb(ids))
        return self.head(h + self.down(F.relu(self.up(h))))


def test_linear_layers_over_the_features_of_a_sequence():
    """The layers after an operation the analysis does not know read the last
    dimension, not the dim 1 taken for its channels: they are not followed
    there (no channel-count error), and the MLP's hidden features, known from
    the layer that writes them, are removed where they are exactly zero."""
    torch.manual_seed(0)
    model = TokenMLP().eval()
    ids = torch.randint(0, 10, (2, 5))
    same = remove_channels(model, example_input=ids)
    assert (same.up.out_features, same.down.in_features) == (8, 8)
    torch.testing.assert_close(same(ids), model(ids))
    with torch.no_grad():
        model.up.weight[[1, 4, 6]] = 0.0
        model.up.bias[[1, 4, 6]] = 0.0
    small = remove_channels(model, example_input=ids)
    assert (small.up.in_features, small.up.out_features, small.down.in_features) == (6, 5, 5)
    assert small.head.in_features == 6  # the residual stream, read after the layer norm, keeps its features
    torch.testing.assert_close(small.down.weight, model.down.weight[:, [0, 2, 3, 5, 7]])
    torch.testing.assert_close(small(ids), model(ids))


def test_grouped_convolutions_and_the_model_output_keep_their_channels():
    model = _sbn(nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4),
                               nn.Conv2d(4, 4, 3, padding=1, groups=2), nn.BatchNorm2d(4)))
    _zero(model[1], [0])  # read by a grouped convolution: stays
    _zero(model[3], [1])  # the model's output: stays
    x = torch.randn(2, 2, 4, 4)
    small = remove_channels(model, example_input=x)
    assert _convs(small) == {"0": (2, 4, 1), "2": (4, 4, 2)}
    torch.testing.assert_close(small(x), model(x), atol=1e-5, rtol=1e-5)


def test_a_layer_called_twice_keeps_one_set_of_channels():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(nn.Conv2d(3, 3, 1, bias=False), nn.BatchNorm2d(3))
            self.b = nn.Sequential(nn.Conv2d(3, 3, 1, bias=False), nn.BatchNorm2d(3))
            self.shared = nn.Conv2d(3, 2, 1)

        def forward(self, x):
            return self.shared(self.a(x)) + self.shared(self.b(x))

    model = _sbn(Twice())
    _zero(model.a[1], [0, 2])
    _zero(model.b[1], [2])  # only channel 2 is zero in both inputs of the shared layer
    x = torch.randn(2, 3, 4, 4)
    small = remove_channels(model, example_input=x)
    assert small.shared.in_channels == 2
    torch.testing.assert_close(small(x), model(x), atol=1e-5, rtol=1e-5)


def test_parametrized_layers_and_untraceable_models_are_clear_errors():
    model = _sbn(nn.Sequential(nn.Conv2d(1, 3, 3, bias=False), nn.BatchNorm2d(3), nn.Conv2d(3, 2, 1)))
    Masker(model)
    _zero(model[1], [0])
    with pytest.raises(ChannelGraphError, match="'0'.*parametrized"):
        remove_channels(model)

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 1)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: neither fx nor export can trace it
                return self.conv(x)
            return self.conv(-x)

    with pytest.raises(ChannelGraphError, match="example_input"):
        remove_channels(Branchy())
    with pytest.raises(ChannelGraphError, match="Branchy"):
        remove_channels(Branchy(), example_input=torch.randn(1, 1, 2, 2))


def test_graph_reports_calls_and_kept_channels():
    model = _sbn(nn.Sequential(nn.Conv2d(1, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1)))
    _zero(model[1], [3])
    g = ChannelGraph(model)
    names = [c.name for c in g.calls]
    assert names == ["0", "1", "3"]
    assert g.keep(g.calls[0].output).tolist() == [0, 1, 2]
    assert g.keep(g.calls[2].input).tolist() == [0, 1, 2]
    assert g.keep(g.calls[0].input).tolist() == [0]  # the model's input


def test_fb_layers_shrink_like_convolutions():
    from prunopt.nn import FBConv2d, to_interspace

    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv2d(2, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
                          nn.Conv2d(6, 6, 3, padding=1, groups=6, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
                          nn.Conv2d(6, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    model = _randomise(convert_to_sparse_batchnorm(to_interspace(model, init="orthonormal"), preserve=False)).eval()
    with torch.no_grad():
        model[0].mask[1, 0, 2] = 0.0  # a pruned coefficient stays pruned in the smaller layer
    _zero(model[4], [2, 3])  # after the depthwise FB layer: both FB layers around it lose 2 and 3
    x = torch.randn(2, 2, 5, 5)
    small = remove_channels(model, example_input=x)
    fb = [m for m in small.modules() if isinstance(m, FBConv2d)]
    assert [(m.in_channels, m.out_channels, m.groups) for m in fb] == [(2, 4, 1), (4, 4, 4), (4, 4, 1)]
    assert [tuple(m.coefficients.shape) for m in fb] == [(4, 2, 9), (4, 1, 9), (4, 4, 9)]
    assert fb[0].mask[1, 0, 2] == 0 and fb[0].mask.shape == fb[0].coefficients.shape
    torch.testing.assert_close(small(x), model(x), atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the eval caches (CSR) are built for the new shapes
        torch.testing.assert_close(small(x), model(x), atol=1e-5, rtol=1e-5)
