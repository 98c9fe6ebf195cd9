// Raw TCP to a loopback HTTP port, for tests that act as a broken or hostile
// client: any bytes out, whatever comes back, and a timeout on everything so
// that a test cannot hang on a server that misbehaves.
#pragma once

#include <string>
#include <vector>

namespace plsh::testing {

struct HttpReply {
  bool connected = false;  // the TCP connection was made
  int status = 0;          // 0: no status line came back (closed or timed out first)
  std::string head;        // status line and headers
  std::string body;
  bool timed_out = false;  // neither a whole reply nor a close within the timeout
  // Value of header `name` (case-insensitive), "" when absent.
  std::string header(const std::string& name) const;
};

// A socket connected to addr ("host:port") with send and receive timeouts;
// -1 on failure or when connecting takes longer than timeout_s.
int connect_to(const std::string& addr, double timeout_s);

// Sends request as is (a send that fails once the server has closed is not
// an error: it may refuse early), then half-closes the socket when
// half_close, and reads until the server closes, the reply's Content-Length
// is in (no body for a HEAD), or timeout_s.
HttpReply http_exchange(const std::string& addr, const std::string& request, double timeout_s = 5,
                        bool half_close = false);

// Opens up to n connections at once (non-blocking connects, then one wait
// of timeout_s) and returns the sockets that connected; the caller closes them.
std::vector<int> connect_many(const std::string& addr, int n, double timeout_s);

// Whether the server closed fd (EOF or reset) within timeout_s; anything it
// sends first is discarded.
bool wait_closed(int fd, double timeout_s);

// Entries in /proc/<pid>/<dir> ("task": threads, "fd": open files); -1 if unreadable.
int proc_entries(int pid, const char* dir);

}  // namespace plsh::testing
