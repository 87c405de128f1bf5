"""umbra.components"""
