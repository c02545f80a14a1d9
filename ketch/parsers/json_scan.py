"""An incremental JSON validator: feed text as it arrives, learn where values start and end.

Tool-call arguments are streamed to the client while the model is still writing them, so we must
know, character by character, that what we forward is a valid JSON prefix and where the members of
the call object (`"name"`, `"arguments"`) begin and end. `json.loads` needs the whole text; this is
a small pushdown automaton over RFC 8259 instead (strict: no control characters inside strings, no
NaN, no trailing commas), so whatever it accepts `json.loads` accepts too.

`scan(text, pos)` consumes from `text[pos:]` and stops at the first event about a member of the
root object (a key, a value start, a value end), at the end of the root value, at an error, or when
the text runs out. Events deeper than the root's members are not reported: nobody needs them.
"""
from __future__ import annotations

import json
import re

# Events returned by JsonScanner.scan.
NEED_MORE, KEY, VALUE_START, VALUE_END, DONE, ERROR = range(6)

# States.
(_VALUE, _OBJ_FIRST, _OBJ_KEY, _COLON, _AFTER, _ARR_FIRST, _STR, _ESC, _HEX,
 _NUM_MINUS, _NUM_ZERO, _NUM_INT, _NUM_DOT, _NUM_FRAC, _NUM_E, _NUM_ESIGN, _NUM_EXP, _LITERAL, _END) = range(19)

_WS = " \t\n\r"
_STR_RUN = re.compile(r'[^"\\\x00-\x1f]*')
_DIGITS = re.compile(r"[0-9]*")
_HEXDIGITS = frozenset("0123456789abcdefABCDEF")
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
# Number states in which the number may end here.
_NUM_FINAL = frozenset((_NUM_ZERO, _NUM_INT, _NUM_FRAC, _NUM_EXP))


class JsonScanner:
    """Validates one JSON value. After an event, `at` is the index it refers to:
    KEY: the key's opening quote (the key ends where scan stopped); VALUE_START: the value's first
    character; VALUE_END and DONE: one past the value's last character."""

    __slots__ = ("_stack", "_state", "_in_key", "_str_start", "_rest", "_hex", "at", "done")

    def __init__(self) -> None:
        self._stack: list[str] = []
        self._state = _VALUE
        self._in_key = False
        self._str_start = 0
        self._rest = ""  # literal characters still expected (true/false/null)
        self._hex = 0  # hex digits still expected after \\u
        self.at = 0
        self.done = False

    @property
    def depth(self) -> int:
        return len(self._stack)

    def _member_level(self) -> bool:
        return len(self._stack) == 1 and self._stack[0] == "{"

    def _value_done(self, end: int) -> int:
        """A value just ended at `end` (exclusive): move on; report it when it matters."""
        if not self._stack:
            self._state, self.done, self.at = _END, True, end
            return DONE
        self._state = _AFTER
        if self._member_level():
            self.at = end
            return VALUE_END
        return NEED_MORE

    def scan(self, text: str, pos: int) -> tuple[int, int]:
        """Consume from text[pos:]; return (event, position after what was consumed)."""
        n = len(text)
        stack = self._stack
        while pos < n:
            st = self._state
            if st == _STR:
                pos = _STR_RUN.match(text, pos).end()
                if pos >= n:
                    break
                c = text[pos]
                pos += 1
                if c == "\\":
                    self._state = _ESC
                elif c == '"':
                    if self._in_key:
                        self._state = _COLON
                        if self._member_level():
                            self.at = self._str_start
                            return KEY, pos
                    else:
                        ev = self._value_done(pos)
                        if ev != NEED_MORE:
                            return ev, pos
                else:
                    return ERROR, pos - 1  # a raw control character inside a string
                continue
            c = text[pos]
            if st in (_NUM_INT, _NUM_FRAC, _NUM_EXP):
                pos = _DIGITS.match(text, pos).end()
                if pos >= n:
                    break
                c = text[pos]
                if st == _NUM_INT and c == ".":
                    self._state, pos = _NUM_DOT, pos + 1
                    continue
                if st != _NUM_EXP and c in "eE":
                    self._state, pos = _NUM_E, pos + 1
                    continue
                ev = self._value_done(pos)  # the delimiter is not consumed: it belongs to the container
                if ev != NEED_MORE:
                    return ev, pos
                continue
            if st in (_VALUE, _OBJ_FIRST, _OBJ_KEY, _COLON, _AFTER, _ARR_FIRST) and c in _WS:
                pos += 1
                continue
            if st == _VALUE or st == _ARR_FIRST:
                if st == _ARR_FIRST and c == "]":
                    stack.pop()
                    ev = self._value_done(pos + 1)
                    if ev != NEED_MORE:
                        return ev, pos + 1
                    pos += 1
                    continue
                starts_member = self._member_level()
                if c == "{" or c == "[":
                    stack.append(c)
                    self._state = _OBJ_FIRST if c == "{" else _ARR_FIRST
                elif c == '"':
                    self._state, self._in_key, self._str_start = _STR, False, pos
                elif c == "-":
                    self._state = _NUM_MINUS
                elif c == "0":
                    self._state = _NUM_ZERO
                elif "1" <= c <= "9":
                    self._state = _NUM_INT
                elif c in _LITERALS:
                    self._state, self._rest = _LITERAL, _LITERALS[c]
                else:
                    return ERROR, pos
                pos += 1
                if starts_member:
                    self.at = pos - 1
                    return VALUE_START, pos
            elif st == _OBJ_FIRST or st == _OBJ_KEY:
                if c == '"':
                    self._state, self._in_key, self._str_start = _STR, True, pos
                elif c == "}" and st == _OBJ_FIRST:
                    stack.pop()
                    ev = self._value_done(pos + 1)
                    if ev != NEED_MORE:
                        return ev, pos + 1
                else:
                    return ERROR, pos
                pos += 1
            elif st == _COLON:
                if c != ":":
                    return ERROR, pos
                self._state, pos = _VALUE, pos + 1
            elif st == _AFTER:
                top = stack[-1]
                if c == ",":
                    self._state = _OBJ_KEY if top == "{" else _VALUE
                    pos += 1
                elif (c == "}" and top == "{") or (c == "]" and top == "["):
                    stack.pop()
                    pos += 1
                    ev = self._value_done(pos)
                    if ev != NEED_MORE:
                        return ev, pos
                else:
                    return ERROR, pos
            elif st == _ESC:
                if c == "u":
                    self._state, self._hex = _HEX, 4
                elif c in '"\\/bfnrt':
                    self._state = _STR
                else:
                    return ERROR, pos
                pos += 1
            elif st == _HEX:
                if c not in _HEXDIGITS:
                    return ERROR, pos
                self._hex -= 1
                if self._hex == 0:
                    self._state = _STR
                pos += 1
            elif st == _LITERAL:
                if c != self._rest[0]:
                    return ERROR, pos
                self._rest = self._rest[1:]
                pos += 1
                if not self._rest:
                    ev = self._value_done(pos)
                    if ev != NEED_MORE:
                        return ev, pos
            elif st == _NUM_MINUS:
                if c == "0":
                    self._state = _NUM_ZERO
                elif "1" <= c <= "9":
                    self._state = _NUM_INT
                else:
                    return ERROR, pos
                pos += 1
            elif st == _NUM_ZERO:
                if c == ".":
                    self._state, pos = _NUM_DOT, pos + 1
                elif c in "eE":
                    self._state, pos = _NUM_E, pos + 1
                else:
                    ev = self._value_done(pos)
                    if ev != NEED_MORE:
                        return ev, pos
            elif st == _NUM_DOT or st == _NUM_ESIGN:
                if not "0" <= c <= "9":
                    return ERROR, pos
                self._state, pos = (_NUM_FRAC if st == _NUM_DOT else _NUM_EXP), pos + 1
            elif st == _NUM_E:
                if c in "+-":
                    self._state = _NUM_ESIGN
                elif "0" <= c <= "9":
                    self._state = _NUM_EXP
                else:
                    return ERROR, pos
                pos += 1
            else:  # _END: nothing may follow the root value inside the scanner
                return ERROR, pos
        return NEED_MORE, pos


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting, still just bad output
        return False
