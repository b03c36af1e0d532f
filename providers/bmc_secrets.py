"""Where a static inventory may take a BMC's password from: a file inside the BMC secrets directory that is none of
Shepherd's own files, or a variable of the BMC password prefix.

An inventory may be another's file (an operator vets it with `shepherd inventory check`), and whatever it names
is sent to the BMC URL it gives. So it reads only what the operator put aside for BMCs: the file is judged by
where it really is, links and `..` followed, and Shepherd's own keys are refused even when one sits in that
directory, by path and by inode (a hard link is the same file).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from foundation.own_secret_files import own_secret_files
from foundation.settings import Settings


@dataclass(frozen=True)
class BmcSecretRules:
    """The BMC secrets directory, the BMC password variables' prefix, and Shepherd's own files (path: what it is)."""

    directory: Path
    variable_prefix: str
    own_files: Mapping[Path, str]

    @classmethod
    def from_settings(cls, settings: Settings, environ: Mapping[str, str] | None = None) -> BmcSecretRules:
        """The rules the settings give: bmc_secrets_dir, bmc_password_env_prefix and every file they name."""
        return cls(
            directory=settings.effective_bmc_secrets_dir,
            variable_prefix=settings.bmc_password_env_prefix,
            own_files=own_secret_files(settings, environ),
        )

    def variable_refusal(self, name: str) -> str | None:
        """Why an inventory may not read the variable name; None when it may."""
        if name.startswith(self.variable_prefix):
            return None
        return (
            f"bmc.password_env {name} does not start with {self.variable_prefix} (setting bmc_password_env_prefix): "
            "an inventory reads only the variables set aside for BMC passwords"
        )

    def file_check(self) -> PasswordFileCheck:
        """A check of password files against these rules, Shepherd's own files looked up once for all of them."""
        return PasswordFileCheck(self)


class PasswordFileCheck:
    """Password files judged against the rules as the file system is now: for one pass over an inventory, or one
    read. The directory and Shepherd's own files are resolved once, the folders of the files once each."""

    def __init__(self, rules: BmcSecretRules) -> None:
        self._rules = rules
        self._directory = Path(os.path.realpath(rules.directory))
        self._own = {Path(os.path.realpath(path)): what for path, what in rules.own_files.items()}
        self._own_inodes: dict[tuple[int, int], str] = {}
        for path, what in self._own.items():
            try:
                status = os.stat(path)
            except OSError:
                continue
            self._own_inodes.setdefault((status.st_dev, status.st_ino), what)
        # A fleet's password files share a few folders; resolving each folder once keeps a pass over 100,000
        # machines at one lstat and one stat a file.
        self._folders: dict[Path, Path] = {}

    def refusal(self, path: Path) -> str | None:
        """Why the file may not serve as a BMC password, for after its path in a message; None when it may."""
        real = self._real(path)
        if self._directory not in real.parents:
            resolved = "" if real == path else f" (it resolves to {real})"
            return (
                f"is outside the BMC secrets directory {self._rules.directory}{resolved}: put it there, or set "
                "bmc_secrets_dir"
            )
        what = self._own.get(real)
        if what is None:
            try:
                status = os.stat(real)
            except OSError:
                return None  # a missing file is the metadata check's to name
            what = self._own_inodes.get((status.st_dev, status.st_ino))
        if what is not None:
            return f"is {what}, never a BMC password"
        return None

    def _real(self, path: Path) -> Path:
        """Where path really is: every link and .. followed."""
        if path.name in ("", ".", ".."):
            return Path(os.path.realpath(path))
        folder = self._folders.get(path.parent)
        if folder is None:
            folder = self._folders[path.parent] = Path(os.path.realpath(path.parent))
        candidate = folder / path.name
        return Path(os.path.realpath(candidate)) if os.path.islink(candidate) else candidate
