"""umbra.cli"""
