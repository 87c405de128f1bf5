"""The Secure Boot db document of an OS image release: the release certificate as PK, KEK and
db, in the shapes GCP (`shieldedInstanceInitialState`) and Azure (`uefiSettings`) take.

Written by the image build (`images/secure_boot.py`), read by the publishing component
(`components/os_image.py`): a wire contract, so it lives in the leaf.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

# The signature owner GUID of our entries in PK/KEK/db (EFI_SIGNATURE_DATA.SignatureOwner).
OWNER_GUID = "3b1e2a7c-6d5f-4c8e-9a0b-7e6d5c4b3a21"


class SecureBootDb(BaseModel):
    """What a cloud needs to enroll the release certificate as the image's Secure Boot state."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cert_der_b64: str
    cert_sha256: str  # of the DER: what a verifier pins against RTMR0's db event
    subject: str
    owner_guid: str = OWNER_GUID

    def document(self) -> dict[str, Any]:
        return {
            "cert_sha256": self.cert_sha256,
            "subject": self.subject,
            "owner_guid": self.owner_guid,
            "cert_der_b64": self.cert_der_b64,
            "gcp_shielded_instance_initial_state": self.gcp_initial_state(),
            "azure_uefi_settings": self.azure_uefi_settings(),
        }

    def gcp_initial_state(self) -> dict[str, Any]:
        """compute.images `shieldedInstanceInitialState` (FileContentBuffer: base64 content,
        fileType X509), the release certificate as PK, the one KEK and the one db entry."""
        buf = {"content": self.cert_der_b64, "fileType": "X509"}
        return {"pk": buf, "keks": [buf], "dbs": [buf], "dbxs": []}

    def azure_uefi_settings(self) -> dict[str, Any]:
        """Gallery image version `securityProfile.uefiSettings`: no Microsoft template, the
        release certificate as PK, KEK and db (UefiKey: type x509, base64 DER values)."""
        key = {"type": "x509", "value": [self.cert_der_b64]}
        return {
            "signatureTemplateNames": ["NoSignatureTemplate"],
            "additionalSignatures": {"pk": key, "kek": [key], "db": [key], "dbx": []},
        }
