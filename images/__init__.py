"""umbra.images"""
