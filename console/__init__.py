"""umbra.console"""
