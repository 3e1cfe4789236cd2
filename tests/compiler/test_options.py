import pytest
import torch

import hecate
from hecate.compiler.options import parse_options
from hecate.passes import PASSES


def test_defaults_enable_every_pattern_with_inductor():
    opts = parse_options(None)
    assert opts.patterns == tuple(PASSES)
    assert opts.fallback == "inductor"
    assert opts.dump_dir is None


def test_unknown_key_names_the_valid_ones():
    with pytest.raises(hecate.HecateOptionsError, match=r"unknown hecate option\(s\) \['patern'\].*fallback"):
        parse_options({"patern": "all"})


def test_bad_fallback_names_the_choices():
    with pytest.raises(hecate.HecateOptionsError, match=r"'fallback' must be one of \['inductor', 'eager'\], got 'tvm'"):
        parse_options({"fallback": "tvm"})


def test_unknown_pattern_names_the_registered_ones():
    with pytest.raises(hecate.HecateOptionsError, match=r"unknown pattern\(s\) \['nope'\]; valid names are"):
        parse_options({"patterns": ["nope"]})


@pytest.mark.parametrize("patterns", ["qk_preprocess", None, 3], ids=["bare_name", "none", "int"])
def test_patterns_must_be_a_list_not_a_bare_name(patterns):
    """None and a number raised a bare TypeError (probe r36)."""
    with pytest.raises(hecate.HecateOptionsError, match=f"must be \"all\" or a list of pattern names, got {patterns!r}"):
        parse_options({"patterns": patterns})


@pytest.mark.parametrize("opset", ["27", 17, 27.0])
def test_an_export_opset_that_is_not_an_int_from_18_is_named(opset, tmp_path):
    """opset_version="27" raised a bare TypeError from a comparison (probe r36)."""
    with pytest.raises(ValueError, match=f"opset_version must be None .* or an int ≥ 18, got {opset!r}"):
        hecate.export_onnx(torch.nn.Linear(2, 2), (torch.randn(1, 2),), tmp_path / "m.onnx", opset_version=opset)


def test_options_must_be_a_dict():
    with pytest.raises(hecate.HecateOptionsError, match="options must be a dict, got list"):
        parse_options(["fallback"])


def test_dump_dir_must_not_be_a_file(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(hecate.HecateOptionsError, match="exists and is not a folder"):
        parse_options({"dump_dir": str(f)})


def test_print_report_must_be_bool():
    with pytest.raises(hecate.HecateOptionsError, match="'print_report' must be True or False, got 'yes'"):
        parse_options({"print_report": "yes"})


def test_bad_option_raises_through_torch_compile(fresh_dynamo):
    f = torch.compile(lambda x: x + 1, backend="hecate", options={"fallback": "tvm"})
    with pytest.raises(Exception, match="'fallback' must be one of"):
        f(torch.ones(3))
