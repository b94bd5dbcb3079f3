// quote.hpp: text from outside (file contents, file names, command-line arguments) inside an
// error message.
//
// Messages reach a terminal. A crafted file must not be able to write control characters
// (terminal escape sequences) or invalid UTF-8 there through a message that quotes it, nor
// fill the screen with a megabyte-long key. So every message that holds such text passes it
// through one of these two functions; both write it as printable ASCII only (0x20 to 0x7e)
// and cut it when long.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace attend::detail {

// Keys, dtypes and option values are short; a longer one is shown by its start.
inline constexpr size_t kMaxQuotedBytes = 64;
// A path that starts a message, or another library's message about the input, is cut only
// when far longer than any real one (PATH_MAX is 4096 on Linux, but real paths are shorter).
inline constexpr size_t kMaxNameBytes = 1024;

// `text` in single quotes, for a key, a dtype, an option value: every byte outside printable
// ASCII written \xNN, backslash and quote written \\ and \'. Longer than `max_bytes`: its
// first `max_bytes` bytes, "..." and the whole length.
//   de<0x05>cr         'de\x05cr'
//   300 times 'a'      'aaa...aaa...' (300 bytes), 64 a's before the "..."
std::string quote_for_message(std::string_view text, size_t max_bytes = kMaxQuotedBytes);

// `text` unquoted, for a file name that starts a message or a whole message that may hold
// bytes of the input (nlohmann::json's parse errors, the CLI's error line): only the bytes
// outside printable ASCII are written \xNN, so that the parts quoted by quote_for_message read
// the same. Cut as quote_for_message cuts.
std::string printable_for_message(std::string_view text, size_t max_bytes = kMaxNameBytes);

}  // namespace attend::detail
