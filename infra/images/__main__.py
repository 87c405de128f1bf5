"""The images stack: `pulumi up -C infra/images -s release` publishes one built OS image as a GCP
image and an Azure Compute Gallery image version (docs/specs/images.md, "Publishing as code").
All logic lives in umbra.components.os_image."""

from umbra.components.os_image import run_images

run_images()
