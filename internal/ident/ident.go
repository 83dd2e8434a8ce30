// Package ident checks the identifiers converge takes from outside or builds
// for outside: idempotency keys, task ids in request paths, artifact tokens.
// They share one alphabet, A–Z a–z 0–9 '_' '.' ':' '-' (the token characters
// of the IETF httpapi Idempotency-Key draft's examples, safe in file names,
// URLs, Kafka headers and log lines), and differ in their lengths and in
// whether the first character must be a letter or digit.
//
// A table lookup per byte replaces the regular expressions these checks were
// written as: on the hot path (every create, every artifact write and
// read-back) regexp's one-pass matcher cost 2 % of the converge process's CPU
// in a profile of the peer bench (BENCHMARKS.md, fourteenth session). The
// expressions stay in the tests as the oracle (FuzzValid).
package ident

// chars marks the bytes of the alphabet; alnum the letters and digits.
var chars, alnum [256]bool

func init() {
	for c := '0'; c <= '9'; c++ {
		chars[c], alnum[c] = true, true
	}
	for c := 'a'; c <= 'z'; c++ {
		chars[c], alnum[c] = true, true
		chars[c-'a'+'A'], alnum[c-'a'+'A'] = true, true
	}
	for _, c := range "_.:-" {
		chars[c] = true
	}
}

// Valid reports whether s is minLen to maxLen bytes (inclusive) of the
// alphabet, and, when alnumFirst, whether its first byte is a letter or digit:
// Valid(s, 6, 255, false) is ^[A-Za-z0-9_.:-]{6,255}$ and Valid(s, 1, 180,
// true) is ^[A-Za-z0-9][A-Za-z0-9_.:-]{0,179}$. Any byte outside ASCII makes s
// invalid, so a valid s is also valid UTF-8 of the same length in characters.
func Valid(s string, minLen, maxLen int, alnumFirst bool) bool {
	if len(s) < minLen || len(s) > maxLen {
		return false
	}
	if alnumFirst && (len(s) == 0 || !alnum[s[0]]) {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !chars[s[i]] {
			return false
		}
	}
	return true
}
