"""Device classes are derived from NVML's name and memory by one table an operator can extend."""
import pytest

from common.device_classes import DeviceClasses, classify


@pytest.mark.parametrize(
    "name, memory_mib, expected",
    [
        ("NVIDIA H100 80GB HBM3", 81559, "H100_80GB"),
        ("NVIDIA H200", 143771, "H200_141GB"),
        ("NVIDIA A100-SXM4-80GB", 81920, "A100_80GB"),
        ("NVIDIA A100-SXM4-40GB", 40960, "A100_40GB"),
        ("NVIDIA H100 NVL", 95830, "H100_94GB"),
        ("NVIDIA L4", 23034, "L4_24GB"),
        ("NVIDIA L40S", 46068, "L40S_48GB"),
        ("Tesla T4", 15360, "T4_16GB"),
    ],
)
def test_builtin_table_maps_nvml_names(name, memory_mib, expected):
    assert expected == classify(name, memory_mib)


def test_operator_rules_win_over_the_builtin_table():
    classes = DeviceClasses.from_rules([{"match": "H100 80GB", "class": "H100_SXM5_80GB"}])
    assert "H100_SXM5_80GB" == classes.classify("NVIDIA H100 80GB HBM3", 81559)
    assert "A100_80GB" == classes.classify("NVIDIA A100-SXM4-80GB", 81920)


def test_operator_rule_with_a_bad_class_name_is_refused():
    with pytest.raises(ValueError, match=r"rules\[0\]\.class"):
        DeviceClasses.from_rules([{"match": "x", "class": "lower case"}])
