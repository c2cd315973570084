import pytest

from hpc_rlhf.utils.imports import ModuleFileMissing, import_target


def test_a_file_and_a_module_are_imported_and_two_files_of_one_name_stay_apart(tmp_path):
    for folder, value in (("a", 1), ("b", 2)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "reward.py").write_text(f"VALUE = {value}\n")
    first = import_target(str(tmp_path / "a" / "reward.py"), "test_")
    second = import_target(str(tmp_path / "b" / "reward.py"), "test_")
    assert (first.VALUE, second.VALUE, first.__name__) == (1, 2, "test_reward")
    assert import_target("json", "test_").dumps([1]) == "[1]"


def test_a_missing_file_is_told_apart_from_an_error_inside_the_users_module(tmp_path):
    with pytest.raises(ModuleFileMissing, match=r"file .*nowhere\.py does not exist"):
        import_target(str(tmp_path / "nowhere.py"), "test_")
    broken = tmp_path / "broken.py"
    broken.write_text("open('missing.txt')\n")
    with pytest.raises(FileNotFoundError) as raised:
        import_target(str(broken), "test_")
    assert not isinstance(raised.value, ModuleFileMissing)
