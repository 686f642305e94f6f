"""What people look at: pictures of the graph and its decisions (`viz`), the explorer
widget (`widgets`), and a policy's rules in words (`explain`).
"""
