"""Emulated clouds: the built CVM OS image booted under QEMU with a stand-in for GCP's metadata
server or Azure's IMDS and wire server, on the addresses the launch agent uses."""
