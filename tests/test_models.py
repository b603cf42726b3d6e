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


def test_small_cnn_accepts_inputs_of_another_size():
    model = build_model("small-cnn", NUM_CLASSES, in_channels=1, image_size=28).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 1, 32, 32)).shape == (2, NUM_CLASSES)


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
    assert num_params(build_model("small-cnn", 10, width=16)) < num_params(build_model("small-cnn", 10))
    assert num_params(build_model("mobilenetv2", 10, width_mult=0.5)) < num_params(build_model("mobilenetv2", 10))
    assert num_params(build_model("densenet", 10, depth=40, growth_rate=12)) < num_params(build_model("densenet", 10))


def test_small_cnn_overfits_a_fixed_batch():
    torch.manual_seed(0)
    model = build_model("small-cnn", 10, in_channels=1, image_size=28)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0], losses


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("vgg16", {}, r"unknown model 'vgg16'.*small-cnn, resnet18, wideresnet, mobilenetv2, densenet"),
        ("small-cnn", {"widht": 64}, r"unknown option\(s\) widht for model 'small-cnn'; valid options: width"),
        ("wideresnet", {"growth_rate": 12}, r"growth_rate.*valid options: depth, widen_factor, dropout"),
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
