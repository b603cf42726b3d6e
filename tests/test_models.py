import pytest
import torch
import torch.nn.functional as F

from raysb.models import MODEL_NAMES, build_model

# An unusual class count, so a hard-coded 10 anywhere shows up as a shape error.
NUM_CLASSES = 7


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_model_names():
    assert MODEL_NAMES == ("small-cnn", "resnet18", "wideresnet", "mobilenetv2", "densenet")


@pytest.mark.parametrize("in_channels, size", [(1, 28), (3, 32)])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_output_shape(name, in_channels, size):
    torch.manual_seed(0)
    model = build_model(name, NUM_CLASSES, in_channels=in_channels, image_size=size).eval()
    with torch.no_grad():
        logits = model(torch.randn(2, in_channels, size, size))
    assert logits.shape == (2, NUM_CLASSES)
    assert torch.isfinite(logits).all()


# Feature-map size before the final pooling for a 32x32 input: the CIFAR variants
# downsample 8x (ResNet-18, MobileNetV2) or 4x (WRN, DenseNet, small-cnn), where the
# ImageNet designs would downsample 32x.
@pytest.mark.parametrize(
    "name, expected_size",
    [("small-cnn", 8), ("resnet18", 4), ("wideresnet", 8), ("mobilenetv2", 4), ("densenet", 8)],
)
def test_downsampling_matches_cifar_variant(name, expected_size):
    # Shallow versions suffice: depth does not change the downsampling.
    options = {"wideresnet": {"depth": 10, "widen_factor": 1}, "densenet": {"depth": 10}}
    model = build_model(name, NUM_CLASSES, **options.get(name, {})).eval()
    final_pool = [m for m in model.modules() if isinstance(m, torch.nn.AdaptiveAvgPool2d)][-1]
    seen = []
    final_pool.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0].shape))
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    assert seen[0][-2:] == (expected_size, expected_size)


def test_small_cnn_accepts_inputs_of_another_size():
    model = build_model("small-cnn", NUM_CLASSES, in_channels=1, image_size=28).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 1, 32, 32)).shape == (2, NUM_CLASSES)


def test_small_cnn_memory_layout_does_not_change_results():
    torch.manual_seed(0)
    model = build_model("small-cnn", NUM_CLASSES, in_channels=1, image_size=28).eval()
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        channels_last = model(x)
        contiguous = model.to(memory_format=torch.contiguous_format)(x)
    torch.testing.assert_close(channels_last, contiguous, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["small-cnn", "resnet18"])
def test_backward_reaches_every_parameter(name):
    torch.manual_seed(0)
    model = build_model(name, NUM_CLASSES, in_channels=3, image_size=32)
    x = torch.randn(2, 3, 32, 32)
    F.cross_entropy(model(x), torch.tensor([0, 1])).backward()
    for param_name, param in model.named_parameters():
        assert param.grad is not None, param_name
        assert torch.isfinite(param.grad).all(), param_name
        assert param.grad.abs().sum() > 0, param_name


@pytest.mark.parametrize(
    "name, options, published",
    [
        ("resnet18", {}, 11.17e6),
        ("wideresnet", {}, 36.5e6),  # WRN-28-10
        ("wideresnet", {"depth": 16, "widen_factor": 8}, 11.0e6),
        ("mobilenetv2", {}, 2.2e6),
        ("densenet", {}, 0.77e6),  # DenseNet-BC-100-12
    ],
)
def test_parameter_count_matches_published(name, options, published):
    model = build_model(name, 10, in_channels=3, image_size=32, **options)
    assert num_params(model) == pytest.approx(published, rel=0.03)


def test_options_change_the_architecture():
    for name, options in [
        ("small-cnn", {"width": 16}),
        ("mobilenetv2", {"width_mult": 0.5}),
        ("densenet", {"depth": 40, "growth_rate": 12}),
    ]:
        default = num_params(build_model(name, 10))
        assert num_params(build_model(name, 10, **options)) < default, name


def test_small_cnn_overfits_a_fixed_batch():
    torch.manual_seed(0)
    model = build_model("small-cnn", 10, in_channels=1, image_size=28)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    losses = []
    for _ in range(20):
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0], losses


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("vgg16", {}, r"unknown model 'vgg16'.*small-cnn, resnet18, wideresnet, mobilenetv2"),
        ("small-cnn", {"widht": 64}, r"unknown option\(s\) widht for model 'small-cnn'.*: width$"),
        ("wideresnet", {"growth_rate": 12}, r"growth_rate.*options: depth, widen_factor, dropout"),
        ("resnet18", {"depth": 34}, r"depth for model 'resnet18'; valid options: none"),
        ("wideresnet", {"depth": 27}, r"wideresnet: depth must be 6n\+4.*got 27"),
        ("wideresnet", {"depth": 4}, r"wideresnet: depth must be 6n\+4.*got 4"),
        ("densenet", {"depth": 99}, r"densenet: depth must be 6n\+4.*got 99"),
        ("small-cnn", {"num_classes": 1}, r"num_classes must be >= 2, got 1"),
        ("densenet", {"in_channels": 0}, r"in_channels must be >= 1, got 0"),
    ],
)
def test_invalid_arguments_raise_value_error(name, kwargs, message):
    kwargs = {"num_classes": 10, **kwargs}
    with pytest.raises(ValueError, match=message):
        build_model(name, **kwargs)
