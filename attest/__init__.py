"""umbra.attest"""
