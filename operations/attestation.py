"""The operator API's side of a verified request: who asked, as the API verified them, and the proof it signs.

The API builds an OperatorClient with one of these for each verified operator; every update the client sends to a
machine's workflow then names that operator and carries the API's signature over it (foundation.operator_proof),
which the workflow checks before it records the request as verified.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from datetime import UTC, datetime

from foundation.operator_proof import ProofSigner
from lifecycle.contracts import MaintenanceRequest, OperatorRequest, RecoveryRequest

# Every request an operator sends a machine's workflow with who asked and, through the API, a proof of it.
Asked = OperatorRequest | MaintenanceRequest | RecoveryRequest


@dataclass(frozen=True)
class Attestation:
    """An operator the API verified (the subject, and how: "oidc" or "certificate") and the API's signer."""

    subject: str
    via: str
    signer: ProofSigner

    def attest(self, workflow_id: str, action: str, request: Asked) -> Asked:
        """The request as the workflow will read it, naming the verified operator, with the API's proof of it."""
        named = dataclasses.replace(request, by=self.subject, proof=None)
        # Signed as the workflow decodes it (text stripped and cut to size), so both sides sign the same bytes.
        sent = type(named).from_wire(json.loads(json.dumps(dataclasses.asdict(named), default=str)))
        proof = self.signer.sign(
            workflow_id=workflow_id,
            action=action,
            by=sent.by,
            via=self.via,
            issued_at=datetime.now(UTC),
            request=sent.signed(),
        )
        return dataclasses.replace(sent, proof=proof)
