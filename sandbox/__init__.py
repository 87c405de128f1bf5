"""umbra.sandbox"""
