import asyncssh
import pytest

from foundation.ssh_identity import SSHIdentityError, load_or_create_ssh_key, public_key_openssh


def test_created_owner_only_when_absent_and_loaded_again(tmp_path):
    path = tmp_path / "keys" / "ssh_key"
    key = load_or_create_ssh_key(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert key.algorithm == b"ssh-ed25519"
    assert path.read_bytes().startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----")
    again = load_or_create_ssh_key(path)
    assert public_key_openssh(again) == public_key_openssh(key)
    assert public_key_openssh(key).startswith("ssh-ed25519 AAAA") and public_key_openssh(key).endswith(" shepherd")
    # Nothing but the key is left in the directory.
    assert list(path.parent.iterdir()) == [path]


def test_existing_directory_is_left_as_it_is(tmp_path):
    path = tmp_path / "ssh_key"
    mode_before = tmp_path.stat().st_mode
    load_or_create_ssh_key(path)
    assert tmp_path.stat().st_mode == mode_before


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o602])
def test_key_accessible_by_others_is_refused_naming_the_file_and_the_fix(tmp_path, mode):
    path = tmp_path / "ssh_key"
    load_or_create_ssh_key(path)
    path.chmod(mode)
    with pytest.raises(SSHIdentityError) as caught:
        load_or_create_ssh_key(path)
    message = str(caught.value)
    assert str(path) in message and f"{mode:04o}" in message and f"chmod 600 {path}" in message
    assert caught.value.path == path


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"garbage", "is not an unencrypted OpenSSH private key"),
        (asyncssh.generate_private_key("ssh-ed25519").export_public_key("openssh"), "holds a public key"),
        (
            asyncssh.generate_private_key("ssh-ed25519").export_private_key("pkcs8-pem", passphrase="x"),
            "is encrypted with a passphrase",
        ),
        (asyncssh.generate_private_key("ecdsa-sha2-nistp256").export_private_key("openssh"), "Shepherd uses ed25519"),
    ],
    ids=["garbage", "public key", "encrypted", "not ed25519"],
)
def test_unusable_key_files_are_refused_naming_the_file(tmp_path, content, words):
    path = tmp_path / "ssh_key"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(SSHIdentityError) as caught:
        load_or_create_ssh_key(path)
    assert str(path) in str(caught.value) and words in str(caught.value)
    # A bad key is reported, never replaced by a new one.
    assert path.read_bytes() == content


def test_directory_in_place_of_the_key_is_refused(tmp_path):
    path = tmp_path / "ssh_key"
    path.mkdir(mode=0o700)
    with pytest.raises(SSHIdentityError, match="not a regular file"):
        load_or_create_ssh_key(path)
