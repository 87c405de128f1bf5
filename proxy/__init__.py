"""umbra.proxy"""
