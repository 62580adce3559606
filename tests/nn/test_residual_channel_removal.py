"""Channel removal in residual blocks (DS eq. 17 export, Lee)."""
import pytest
import torch
from torch import nn

from prunopt.nn import SparseBatchNorm2d, convert_to_sparse_batchnorm, remove_channels
from prunopt.train.models import BasicBlock, SmallResNet


def _randomise(model):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SparseBatchNorm2d):
                m.gate.alpha.uniform_(0.2, 1.0)
                m.gate.alpha.mul_(torch.randint(0, 2, m.gate.alpha.shape) * 2 - 1)  # signed gates
                m.shift.normal_()
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2)
    return model


def _zero(bn, channels):
    with torch.no_grad():
        bn.gate.alpha[list(channels)] = 0.0  # alpha = 0 -> a = 0 exactly


def _resnet(seed=0, width=8):
    torch.manual_seed(seed)
    return _randomise(convert_to_sparse_batchnorm(SmallResNet(width=width), preserve=False)).eval()


def _nparams(m):
    return sum(p.numel() for p in m.parameters())


def test_internal_and_residual_stream_channels_are_removed():
    model = _resnet()
    f = model.features  # 0 conv, 1 bn, 2 relu, 3-4 blocks (8 ch), 5 projection block (16 ch), 6 block, 7 pool
    stem_bn, b0, b1, b2, b3 = f[1], f[3], f[4], f[5], f[6]
    # internal channels: a zero gate in bn1 is enough
    _zero(b0.bn1, [1, 3, 5])
    _zero(b2.bn1, [0, 15])
    # stream 1 (stem, b0, b1: 8 ch): channel 2 is zero in every path that adds into it,
    # channel 4 only in the stem and b0 (b1 adds into it): 4 must be kept
    for bn in (stem_bn, b0.bn2, b1.bn2):
        _zero(bn, [2])
    _zero(stem_bn, [4])
    _zero(b0.bn2, [4])
    # stream 2 (projection shortcut of b2, b2, b3: 16 ch): 0 and 7 zero everywhere, 9 only on the shortcut
    for bn in (b2.shortcut[1], b2.bn2, b3.bn2):
        _zero(bn, [0, 7])
    _zero(b2.shortcut[1], [9])
    x = torch.rand(6, 1, 8, 8)
    ref = model(x)
    small = remove_channels(model, example_input=x)
    torch.testing.assert_close(small(x), ref, atol=1e-5, rtol=1e-5)
    assert _nparams(small) < _nparams(model)
    sf = small.features
    assert sf[0].out_channels == 7 and sf[1].num_features == 7
    assert (sf[3].conv1.in_channels, sf[3].conv1.out_channels, sf[3].conv2.in_channels, sf[3].conv2.out_channels) \
        == (7, 5, 5, 7)
    assert (sf[4].conv1.in_channels, sf[4].conv2.out_channels) == (7, 7)
    assert (sf[5].conv1.in_channels, sf[5].conv1.out_channels, sf[5].conv2.in_channels) == (7, 14, 14)
    assert (sf[5].shortcut[0].in_channels, sf[5].shortcut[0].out_channels, sf[5].conv2.out_channels) == (7, 14, 14)
    assert (sf[6].conv1.in_channels, sf[6].conv2.out_channels) == (14, 14)
    assert small.classifier.in_features == 14
    assert not any(isinstance(m, SparseBatchNorm2d) for m in small.modules())
    torch.testing.assert_close(model(x), ref)  # the original is untouched


def test_residual_channel_kept_when_one_path_is_nonzero():
    model = _resnet(1)
    f = model.features
    for bn in (f[1], f[3].bn2):  # b1 (f[4]) still adds into channel 5
        _zero(bn, [5])
    x = torch.rand(3, 1, 8, 8)
    small = remove_channels(model, example_input=x)
    assert small.features[0].out_channels == 8 and small.features[4].conv2.out_channels == 8
    assert _nparams(small) == _nparams(model) - sum(
        m.shift.numel() + m.gate.alpha.numel() + m.gate.beta.numel() - 2 * m.num_features
        for m in model.modules() if isinstance(m, SparseBatchNorm2d))  # only the BN parameterisation changes


def test_fully_zero_residual_stream_and_float64():
    model = _resnet(2).double()
    f = model.features
    for bn in (f[1], f[3].bn2, f[4].bn2):
        _zero(bn, range(8))
    x = torch.rand(2, 1, 8, 8, dtype=torch.float64)
    small = remove_channels(model)
    torch.testing.assert_close(small(x), model(x), atol=1e-12, rtol=0)
    assert small.features[0].out_channels == 1  # torch has no 0-channel conv


class _PreActBlock(nn.Module):
    """A block shape the export does not know (BN before conv): kept whole."""

    def __init__(self, c):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(c)
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.shortcut = nn.Identity()

    def forward(self, x):
        return self.conv2(self.bn2(self.conv1(self.bn1(x).relu())).relu()) + x


def test_unknown_block_shape_is_exported_exactly():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
                          _PreActBlock(6), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3))
    model = _randomise(convert_to_sparse_batchnorm(model, preserve=False)).eval()
    _zero(model[1], [0, 1])
    _zero(model[3].bn1, [2])
    x = torch.rand(2, 1, 8, 8)
    small = remove_channels(model, example_input=x)
    torch.testing.assert_close(small(x), model(x), atol=1e-5, rtol=1e-5)
    assert small[0].out_channels == 6 and small[3].conv1.in_channels == 6


def test_torchvision_style_downsample_attribute():
    class Block(BasicBlock):
        def __init__(self, cin, cout, stride=1):
            super().__init__(cin, cout, stride)
            self.downsample = self.shortcut if isinstance(self.shortcut, nn.Sequential) else None
            del self.shortcut

        def forward(self, x):
            out = self.bn2(self.conv2(self.bn1(self.conv1(x)).relu()))
            return (out + (x if self.downsample is None else self.downsample(x))).relu()

    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                          Block(4, 4), Block(4, 6, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 2))
    model = _randomise(convert_to_sparse_batchnorm(model, preserve=False)).eval()
    for bn in (model[1], model[3].bn2):
        _zero(bn, [3])
    _zero(model[4].bn1, [1])
    for bn in (model[4].downsample[1], model[4].bn2):
        _zero(bn, [5])
    x = torch.rand(4, 1, 8, 8)
    small = remove_channels(model, example_input=x)
    torch.testing.assert_close(small(x), model(x), atol=1e-5, rtol=1e-5)
    assert small[0].out_channels == 3 and small[4].downsample[0].in_channels == 3
    assert small[4].conv1.out_channels == 5 and small[4].conv2.out_channels == 5 and small[7].in_features == 5


def test_trained_resnet_export_matches(tmp_path):
    # a short DS training run, then the export: outputs identical in eval mode
    from prunopt.nn import l1_regularizer, sparse_gates

    torch.manual_seed(0)
    model = convert_to_sparse_batchnorm(SmallResNet(width=4), preserve=False)
    gates = [p for n, p in model.named_parameters() if ".gate." in n]
    opt = torch.optim.SGD(gates, lr=0.5, momentum=0.9)
    x, y = torch.rand(32, 1, 8, 8), torch.randint(0, 10, (32,))
    for _ in range(12):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y) + 0.2 * l1_regularizer(sparse_gates(model))
        loss.backward()
        opt.step()
    model.eval()
    assert any((g == 0).any() for g in sparse_gates(model))
    small = remove_channels(model, example_input=x)
    torch.testing.assert_close(small(x), model(x), atol=1e-5, rtol=1e-5)
    assert _nparams(small) < _nparams(model)
    widths = [m.out_channels for m in small.modules() if isinstance(m, nn.Conv2d)]
    # residual-stream channels removed (stem or second stage), not everything
    assert (small.features[0].out_channels < 4 or small.features[5].conv2.out_channels < 8) and max(widths) > 1
