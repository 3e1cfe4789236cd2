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


def test_patterns_must_be_a_list_not_a_bare_name():
    with pytest.raises(hecate.HecateOptionsError, match="must be \"all\" or a list"):
        parse_options({"patterns": "qk_preprocess"})


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
