import asyncssh
import pytest

from shepherd.ssh_identity import SSHIdentityError, load_or_create_ssh_key, public_key_openssh


def test_created_owner_only_when_absent_and_loaded_again(tmp_path):
    path = tmp_path / "keys" / "ssh_key"
    key = load_or_create_ssh_key(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert key.algorithm == b"ssh-ed25519"
    again = load_or_create_ssh_key(path)
    assert public_key_openssh(again) == public_key_openssh(key)
    assert public_key_openssh(key).startswith("ssh-ed25519 ")


def test_key_readable_by_others_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "ssh_key"
    load_or_create_ssh_key(path)
    path.chmod(0o644)
    with pytest.raises(SSHIdentityError) as caught:
        load_or_create_ssh_key(path)
    assert str(path) in str(caught.value) and "0644" in str(caught.value) and "chmod 600" in str(caught.value)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"garbage", "not an unencrypted OpenSSH private key"),
        (asyncssh.generate_private_key("ssh-ed25519").export_public_key("openssh"), "not an unencrypted"),
        (asyncssh.generate_private_key("ssh-ed25519").export_private_key("pkcs8-pem", passphrase="x"), "not an"),
        (asyncssh.generate_private_key("ecdsa-sha2-nistp256").export_private_key("openssh"), "uses ed25519"),
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
